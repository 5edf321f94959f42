"""The run's data: its tokenizer, and the train, eval and warm-start prompts read with it.

    data = Datasets.load(cfg)     every file read and checked before any model is built
    data.stats                    data/<split>_prompts, data/<split>_skipped[/<reason>] for the log
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vapo_megatron.config import Config, ConfigError
from vapo_megatron.data.prompts import LoadStats, PromptRecord, load_prompts


def load_metrics(split: str, stats: LoadStats) -> dict[str, float]:
    """data/<split>_prompts, data/<split>_skipped and one data/<split>_skipped/<reason> each."""
    out = {f"data/{split}_prompts": float(stats.loaded), f"data/{split}_skipped": float(sum(stats.skipped.values()))}
    out |= {f"data/{split}_skipped/{reason}": float(n) for reason, n in sorted(stats.skipped.items())}
    return out


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """What ends a response: EOS first (it is also what an empty response is given), then PAD."""
    return tuple(dict.fromkeys(t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None))


def load_tokenizer(hf_dir: str, vocab_size: int, source: str):
    """The model's tokenizer; ConfigError when it has ids past the embedding (they would fail mid-run)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"model.hf_path: the tokenizer has {len(tokenizer)} tokens, more than "
                          f"vocab_size={vocab_size} in {source}")
    return tokenizer


@dataclass
class Datasets:
    tokenizer: object
    train: list[PromptRecord]
    eval: list[PromptRecord]          # the first eval.max_prompts of data.eval_files
    # Warm-start examples (sft.files), read with the rest so that a bad file stops the run before
    # any model is built; empty when sft.steps == 0.
    sft: list[PromptRecord] = field(default_factory=list)
    # What loading kept and skipped, per split and reason (data/train_skipped/too_long, ...):
    # logged once at the start of a run so that skipped prompts are visible in the metrics.
    stats: dict[str, float] = field(default_factory=dict)

    @classmethod
    def load(cls, cfg: Config, hf_cfg: dict) -> "Datasets":
        tokenizer = load_tokenizer(cfg.model.hf_path, hf_cfg["vocab_size"], hf_cfg["_source"])
        d = cfg.data
        common = dict(max_prompt_tokens=d.max_prompt_tokens, apply_chat_template=d.apply_chat_template)
        stats: dict[str, float] = {}
        train, s = load_prompts(list(d.train_files), tokenizer, schema=d.schema, **common)
        stats |= load_metrics("train", s)
        evals: list[PromptRecord] = []
        if d.eval_files:
            evals, s = load_prompts(list(d.eval_files), tokenizer, schema=d.schema, **common)
            stats |= load_metrics("eval", s)
            evals = evals[: cfg.eval.max_prompts]
        sft: list[PromptRecord] = []
        if cfg.sft.steps > 0:
            sft, s = load_prompts(list(cfg.sft.files), tokenizer, schema="simple", **common)
            stats |= load_metrics("sft", s)
        return cls(tokenizer, train, evals, sft, stats)


def repeat_warnings(cfg: Config, data: Datasets) -> list[str]:
    """A batch larger than its data repeats prompts within one step (PromptSampler runs on into
    the next epoch): legal, but rarely meant, so said once at the start."""
    out = []
    for key, n, batch, batch_key in (("data.train_files", len(data.train), cfg.rollout.prompts_per_step,
                                      "rollout.prompts_per_step"),
                                     ("sft.files", len(data.sft), cfg.sft.batch_size, "sft.batch_size")):
        if 0 < n < batch:
            out.append(f"[vapo] warning: {key} hold {n} usable prompts, fewer than {batch_key}={batch}: "
                       "every batch repeats prompts")
    return out


__all__ = ["Datasets", "repeat_warnings", "load_metrics", "load_tokenizer", "stop_token_ids"]
