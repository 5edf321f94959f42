"""Steps 1-3 of the loop: prompts of this DP rank, rollout on its engines, rewards.

Engine placement. The embedded engine and an SGLang HTTP server: one engine per model replica
(DP rank), held by the replica's first rank (TP rank 0, PP stage 0). Colocated SGLang: one
engine per block of rollout.sglang_tp ranks of every TP group, so a replica (TP x PP ranks)
has TP*PP/sglang_tp engines (parallel.init_engine_groups). Either way the replica's prompts
are split evenly over its generating ranks, and the token ids are then shared with every rank
of the replica (the model-parallel group), which all need the batch. Sampling seeds are a pure
function of (trainer seed, iteration, DP rank, prompt and sample index), whatever the split,
so a resumed run draws the same rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import model_providers
from vapo_megatron import parallel
from vapo_megatron.batch import RolloutBatch, pack_sequences
from vapo_megatron.config import Config, ConfigError
from vapo_megatron.data.prompts import PromptRecord, load_prompts
from vapo_megatron.gpu_memory import free_cached_memory
from vapo_megatron.rewards import build_reward_fn, score_batch
from vapo_megatron.rewards.answers import AnswerKey
from vapo_megatron.rollout.base import RolloutEngine, RolloutOutput, SamplingParams


@dataclass
class Rollout:
    """This DP rank's prompts and their sampled responses (n per prompt, grouped)."""

    prompts: list[PromptRecord]
    outputs: list[RolloutOutput]
    n: int


def _build_engine(cfg: Config, *, with_weights: bool = True) -> RolloutEngine | None:
    """Collective (colocated SGLang starts its engines together). None on ranks with no engine.
    with_weights=False: model.hf_path holds only config and tokenizer (a trainer checkpoint's
    hf/); the engine starts with placeholder weights, which the first weight sync replaces."""
    r = cfg.rollout
    if r.engine == "sglang":
        from vapo_megatron.rollout.sglang_engine import SGLangEngine

        return SGLangEngine.colocated(model_path=cfg.model.hf_path, tp_size=r.sglang_tp, mem_fraction=r.sglang_mem_fraction,
                                      dtype=cfg.model.dtype, seed=cfg.trainer.seed,
                                      deterministic=cfg.trainer.deterministic, load_format="auto" if with_weights else "dummy")
    if not (parallel.tp_rank() == 0 and parallel.pp_rank() == 0):
        return None
    if r.engine == "embedded":
        from transformers import AutoConfig

        from vapo_megatron.rollout.embedded import EmbeddedEngine

        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        if not with_weights:
            return EmbeddedEngine.from_hf_config(AutoConfig.from_pretrained(cfg.model.hf_path), dtype=dtype, device=str(parallel.device()))
        return EmbeddedEngine.from_pretrained(cfg.model.hf_path, dtype=dtype, device=str(parallel.device()))
    from vapo_megatron.rollout.sglang_engine import SGLangEngine
    from vapo_megatron.rollout.sglang_http import HttpEngine

    return SGLangEngine(HttpEngine(r.sglang_urls[parallel.dp_rank() % len(r.sglang_urls)]))


def generating_ranks(engine: RolloutEngine | None) -> list[int]:
    """Collective over the model-parallel group: the global ranks of this replica that
    generate, in group order (the order their prompt shares are assigned in)."""
    mp_group = parallel.model_parallel_group()
    flags = [False] * dist.get_world_size(mp_group)
    parallel.all_gather_object(flags, engine is not None and engine.generates, group=mp_group)
    ranks = [r for r, f in zip(dist.get_process_group_ranks(mp_group), flags) if f]
    if not ranks:
        raise RuntimeError("no rank of this model replica holds a rollout engine")
    return ranks


def _load_metrics(split: str, stats) -> dict[str, float]:
    """data/<split>_prompts, data/<split>_skipped and one data/<split>_skipped/<reason> each."""
    out = {f"data/{split}_prompts": float(stats.loaded), f"data/{split}_skipped": float(sum(stats.skipped.values()))}
    out |= {f"data/{split}_skipped/{reason}": float(n) for reason, n in sorted(stats.skipped.items())}
    return out


@dataclass
class RolloutContext:
    cfg: Config
    hf_cfg: dict
    tokenizer: object
    train_records: list[PromptRecord]
    eval_records: list[PromptRecord]
    reward_fn: object
    engine: RolloutEngine | None
    stop_token_ids: tuple[int, ...]
    # Warm-start examples (sft.files), read here with the other data so that a bad file stops
    # the run before any model is built; empty when sft.steps == 0.
    sft_records: list[PromptRecord] = field(default_factory=list)
    # Global ranks of this model replica that generate (generating_ranks), in share order.
    generators: list[int] = field(default_factory=list)
    # What loading kept and skipped, per split and reason (data/train_skipped/too_long, ...):
    # logged once at the start of a run so that skipped prompts are visible in the metrics.
    data_stats: dict[str, float] = field(default_factory=dict)
    # Answer extraction and equivalence for maj@K (sampled_eval.py); its pool starts at first use.
    answers: AnswerKey | None = None

    @classmethod
    def build(cls, cfg: Config) -> "RolloutContext":
        hf_cfg = model_providers.load_hf_config(cfg.model.hf_path)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        if len(tokenizer) > hf_cfg["vocab_size"]:  # ids past the embedding would fail mid-run
            raise ConfigError(f"model.hf_path: the tokenizer has {len(tokenizer)} tokens, more than "
                              f"vocab_size={hf_cfg['vocab_size']} in {hf_cfg['_source']}")
        d = cfg.data
        data_stats: dict[str, float] = {}
        train, stats = load_prompts(list(d.train_files), tokenizer, max_prompt_tokens=d.max_prompt_tokens,
                                    apply_chat_template=d.apply_chat_template, schema=d.schema)
        data_stats |= _load_metrics("train", stats)
        evals: list[PromptRecord] = []
        if d.eval_files:
            evals, stats = load_prompts(list(d.eval_files), tokenizer, max_prompt_tokens=d.max_prompt_tokens,
                                        apply_chat_template=d.apply_chat_template, schema=d.schema)
            data_stats |= _load_metrics("eval", stats)
            evals = evals[: cfg.eval.max_prompts]
        sft: list[PromptRecord] = []
        if cfg.sft.steps > 0:
            sft, stats = load_prompts(list(cfg.sft.files), tokenizer, max_prompt_tokens=d.max_prompt_tokens,
                                      apply_chat_template=d.apply_chat_template, schema="simple")
            data_stats |= _load_metrics("sft", stats)
        reward_fn = build_reward_fn(cfg.reward.fn, correct_score=cfg.reward.correct_score,
                                    incorrect_score=cfg.reward.incorrect_score, timeout_s=cfg.reward.timeout_s)
        # EOS first: it is also what an empty response is given (see score()).
        stops = tuple(dict.fromkeys(t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None))
        engine = _build_engine(cfg)
        answers = AnswerKey(cfg.reward.fn, timeout_s=cfg.reward.timeout_s)
        return cls(cfg, hf_cfg, tokenizer, train, evals, reward_fn, engine, stops, sft, generating_ranks(engine), data_stats, answers)

    def dp_share(self, records: list) -> list:
        """This DP rank's contiguous share (whole prompt groups stay on one rank)."""
        per = len(records) // parallel.dp_size()
        return records[parallel.dp_rank() * per : (parallel.dp_rank() + 1) * per]

    def sampling(self, *, seed: int, greedy: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        if greedy:
            return SamplingParams(n=1, temperature=0.0, max_new_tokens=r.max_new_tokens, stop_token_ids=self.stop_token_ids, seed=seed)
        return SamplingParams(n=r.n_samples, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=self.stop_token_ids, seed=seed)

    def score(self, rollout: Rollout) -> tuple[RolloutBatch, dict[str, float]]:
        """Step 3: verifier rewards; then the batch tensors of this rank."""
        texts = [self.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in rollout.outputs]
        answers = [rollout.prompts[o.prompt_index].answer for o in rollout.outputs]
        prompt_texts = [rollout.prompts[o.prompt_index].prompt_text for o in rollout.outputs]
        scores, correct, counters = score_batch(self.reward_fn, prompt_texts, texts, answers)
        prompt_ids = [rollout.prompts[o.prompt_index].prompt_ids for o in rollout.outputs]
        # An empty response still occupies one position: the engine's stop token.
        responses = [o.token_ids if o.token_ids else [self.stop_token_ids[0]] for o in rollout.outputs]
        tokens, pl, rl = pack_sequences(prompt_ids, responses)
        batch = RolloutBatch(
            tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=scores.float(), correct=correct.bool(),
            group_ids=torch.tensor([o.prompt_index for o in rollout.outputs], dtype=torch.long),
        )
        engine_logp = [o.logprobs for o in rollout.outputs]
        if all(lp is not None for lp in engine_logp):
            batch.extras["engine_logp"] = engine_logp
        stats = torch.tensor([
            float(scores.sum()), float(correct.sum()), float(len(texts)), float(rl.sum()),
            float(sum(o.finish_reason == "length" for o in rollout.outputs)),
            float(counters["reward/timeouts"]), float(counters["reward/errors"]),
        ], dtype=torch.float64)
        max_len = torch.tensor([float(rl.max())])
        if parallel.dp_size() > 1:
            parallel.all_reduce(stats, group=parallel.dp_group())
            parallel.all_reduce(max_len, op=dist.ReduceOp.MAX, group=parallel.dp_group())
        total, n_correct, count, length_sum, truncated, timeouts, errors = stats.tolist()
        logs = {
            "reward/mean": total / count,
            "reward/accuracy": n_correct / count,
            "reward/timeouts": timeouts,
            "reward/errors": errors,
            "response_length/mean": length_sum / count,
            "response_length/max": float(max_len),
            "response_length/clip_ratio": truncated / count,
        }
        return batch, logs

    def close(self) -> None:
        if self.answers is not None:
            self.answers.close()
        if self.engine is not None and hasattr(self.engine, "shutdown"):
            self.engine.shutdown()


def _generate_and_share(ctx: RolloutContext, prompts: list[PromptRecord], params: SamplingParams) -> list[RolloutOutput]:
    """Each generating rank of the replica samples its contiguous share of `prompts`; every
    rank of the replica gets all outputs, grouped by prompt. Seeds are offset by the share's
    start, so the samples do not depend on how many engines there are."""
    per = -(-len(prompts) // len(ctx.generators))
    mine: list[RolloutOutput] = []
    if ctx.engine is not None and ctx.engine.generates:
        start = ctx.generators.index(dist.get_rank()) * per
        share = prompts[start : start + per]
        if share:
            free_cached_memory()  # weight-sync buckets and training leftovers, before the KV cache returns
            ctx.engine.resume_memory(("kv_cache", "cuda_graph"))
            outs = ctx.engine.generate([p.prompt_ids for p in share], replace(params, seed=params.seed + start * params.n))
            ctx.engine.release_memory(("kv_cache", "cuda_graph"))
            mine = [replace(o, prompt_index=o.prompt_index + start) for o in outs]
    mp_group = parallel.model_parallel_group()
    if dist.get_world_size(mp_group) == 1:
        return mine
    gathered: list = [None] * dist.get_world_size(mp_group)
    parallel.all_gather_object(gathered, mine, group=mp_group)
    by_rank = dict(zip(dist.get_process_group_ranks(mp_group), gathered))
    return [o for r in ctx.generators for o in by_rank[r]]


def release_engine_weights(ctx: RolloutContext) -> None:
    """Before the updates: the engine's weights make room for training; the weight sync that
    ends the step loads them again (SGLang; the embedded engine keeps its weights)."""
    if ctx.engine is not None:
        ctx.engine.release_memory(("weights",))
    free_cached_memory()  # the rollout phase's blocks: training starts from an empty cache


def collect_rollouts(ctx: RolloutContext, global_prompts: list[PromptRecord], *, seed: int) -> Rollout:
    """Step 2: n samples for each of this DP rank's prompts."""
    prompts = ctx.dp_share(global_prompts)
    outputs = _generate_and_share(ctx, prompts, ctx.sampling(seed=seed))
    return Rollout(prompts=prompts, outputs=outputs, n=ctx.cfg.rollout.n_samples)


def evaluate(ctx: RolloutContext, records: list[PromptRecord] | None = None) -> float:
    """Greedy accuracy over all DP ranks; by default on the held-out set (eval/accuracy)."""
    records = ctx.eval_records if records is None else records
    per = -(-len(records) // parallel.dp_size())
    mine = records[parallel.dp_rank() * per : (parallel.dp_rank() + 1) * per]
    correct = 0.0
    if mine:
        outputs = _generate_and_share(ctx, mine, ctx.sampling(seed=0, greedy=True))
        texts = [ctx.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outputs]
        _, ok, _ = score_batch(ctx.reward_fn, [r.prompt_text for r in mine], texts, [r.answer for r in mine])
        correct = float(ok.sum())
    t = torch.tensor([correct], dtype=torch.float64)
    if parallel.dp_size() > 1:
        parallel.all_reduce(t, group=parallel.dp_group())
    return float(t) / max(len(records), 1)
