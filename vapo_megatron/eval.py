"""vapo-eval: avg@K, pass@k and maj@K of a model on held-out prompts, as the paper reports them.

    vapo-eval --model DIR --data FILE [FILE ...] --n-samples K --out OUT_DIR [--reward math]
    torchrun --nproc-per-node N -m vapo_megatron.eval --model DIR ...   (prompts split over ranks)

--model is a Hugging Face model directory or a trainer checkpoint: the actor directory
(run_dir/checkpoints/iter_N/actor) or the iteration directory holding it. A checkpoint's weights
are loaded into a Megatron model and streamed into the rollout engine by the trainer's own
weight sync. Sampling, rewards and engines are the trainer's (sampled_eval.py), so the figures
match the periodic eval/avg@K of a run. Writes OUT_DIR/samples.jsonl (one object per sample),
OUT_DIR/per_prompt.csv and OUT_DIR/summary.json, and prints the same figures.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

EXIT_BAD_INPUT = 2


class EvalInputError(ValueError):
    """Bad input to vapo-eval; the message names the argument, file or directory."""


@dataclass(frozen=True)
class ModelSource:
    hf_dir: Path             # config and tokenizer (and, for an HF model, the weights)
    checkpoint: Path | None  # the actor's Megatron dist checkpoint, or None for an HF model


def resolve_model(path: str) -> ModelSource:
    """An HF directory (config.json + *.safetensors) or a trainer/vapo-convert checkpoint."""
    p = Path(path)
    if not p.exists():
        raise EvalInputError(f"--model {path}: does not exist")
    if not p.is_dir():
        raise EvalInputError(f"--model {path}: not a directory")
    if (p / "actor").is_dir() and not (p / "config.json").exists():
        p = p / "actor"  # run_dir/checkpoints/iter_N
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return ModelSource(hf_dir=p, checkpoint=None)
    if (p / "metadata.json").exists() or (p / "vapo.json").exists():
        for need in ("metadata.json", "vapo.json", "hf/config.json"):
            if not (p / need).is_file():
                raise EvalInputError(f"--model {p}: unreadable checkpoint: {p / need} is missing")
        from vapo_megatron.checkpoint_io import CheckpointError, require_checkpoint

        try:
            require_checkpoint(p)
        except CheckpointError as e:
            raise EvalInputError(f"--model {p}: unreadable checkpoint: {e}") from None
        except ValueError as e:  # megatron's check parses metadata.json and lets a JSON error through
            raise EvalInputError(f"--model {p}: unreadable checkpoint: {p / 'metadata.json'}: {type(e).__name__}: {e}") from None
        try:
            critic = json.loads((p / "vapo.json").read_text())["critic"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise EvalInputError(f"--model {p}: unreadable checkpoint: {p / 'vapo.json'} ({type(e).__name__}: {e})") from None
        if critic:
            raise EvalInputError(f"--model {p}: a critic checkpoint; give the actor's (iter_N/actor)")
        return ModelSource(hf_dir=p / "hf", checkpoint=p)
    raise EvalInputError(f"--model {path}: neither a Hugging Face model directory (config.json and *.safetensors) "
                         "nor a trainer checkpoint (iter_N or iter_N/actor: metadata.json, vapo.json, hf/)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vapo-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory, or trainer checkpoint (iter_N or iter_N/actor)")
    p.add_argument("--data", required=True, nargs="+", help="eval files (.jsonl/.parquet; simple or dapo schema)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--n-samples", type=int, default=32, help="K samples per prompt (default 32, the paper's avg@32)")
    p.add_argument("--pass-k", type=int, nargs="+", default=None, help="k for pass@k (default 1, 2, 4, ..., K)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0, the training temperature)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--max-new-tokens", type=int, default=20480)
    p.add_argument("--seed", type=int, default=0, help="sample j of prompt i uses seed + i*K + j")
    p.add_argument("--greedy", action="store_true", help="also report greedy accuracy")
    p.add_argument("--reward", default="math", help="math | exact | package.module:function (as in training)")
    p.add_argument("--correct-score", type=float, default=1.0)
    p.add_argument("--incorrect-score", type=float, default=-1.0)
    p.add_argument("--reward-timeout", type=float, default=5.0, help="seconds per reward check (hard bound)")
    p.add_argument("--schema", choices=("auto", "simple", "dapo"), default="auto")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts as plain text")
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="longer prompts are skipped (counted)")
    p.add_argument("--max-prompts", type=int, default=None, help="evaluate only the first N prompts")
    p.add_argument("--engine", choices=("embedded", "sglang"), default="embedded", help="embedded (CPU/one GPU) or colocated SGLang")
    p.add_argument("--sglang-tp", type=int, default=1)
    p.add_argument("--sglang-mem-fraction", type=float, default=0.8)
    p.add_argument("--deterministic", action="store_true", help="SGLang deterministic inference: only then does SGLang "
                   "honour the per-sample seeds (slower); the embedded engine always does")
    p.add_argument("--tp", type=int, default=1, help="Megatron TP for loading a checkpoint (ranks = tp * pp * dp)")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: bfloat16 on GPU, float32 on CPU")
    return p.parse_args(argv)


def check_args(a: argparse.Namespace) -> list[int]:
    """Everything checkable before a model is built; returns the pass@k ladder."""
    from vapo_megatron.eval_metrics import k_ladder

    if a.n_samples < 1:
        raise EvalInputError(f"--n-samples {a.n_samples}: must be >= 1")
    ks = a.pass_k or k_ladder(a.n_samples)
    for k in ks:
        if not 1 <= k <= a.n_samples:
            raise EvalInputError(f"--pass-k {k}: pass@k needs 1 <= k <= --n-samples ({a.n_samples})")
    if a.temperature <= 0:
        raise EvalInputError(f"--temperature {a.temperature}: must be > 0 (use --greedy for greedy accuracy)")
    if not 0 < a.top_p <= 1:
        raise EvalInputError(f"--top-p {a.top_p}: must be in (0, 1]")
    if a.max_new_tokens < 1 or a.max_prompt_tokens < 1:
        raise EvalInputError("--max-new-tokens and --max-prompt-tokens must be >= 1")
    if a.max_prompts is not None and a.max_prompts < 1:
        raise EvalInputError(f"--max-prompts {a.max_prompts}: must be >= 1")
    if not (a.reward in ("math", "exact") or a.reward.count(":") == 1):
        raise EvalInputError(f"--reward {a.reward!r}: must be math, exact or package.module:function")
    if a.correct_score <= a.incorrect_score:
        raise EvalInputError("--correct-score must be greater than --incorrect-score")
    for f in a.data:
        if not os.path.isfile(f):
            raise EvalInputError(f"--data {f}: no such file")
    return sorted(set(ks))


def build_config(a: argparse.Namespace, model: ModelSource):
    """The trainer's Config for the pieces it shares with vapo-eval (engine, sampling, reward)."""
    import torch

    from vapo_megatron.config import (Config, DataConfig, ModelConfig, ParallelConfig, RewardConfig, RolloutConfig,
                                      TrainerConfig)

    dtype = a.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    return Config(
        model=ModelConfig(hf_path=str(model.hf_dir), dtype=dtype),
        parallel=ParallelConfig(tp=a.tp, pp=a.pp),
        rollout=RolloutConfig(engine=a.engine, n_samples=a.n_samples, temperature=a.temperature, top_p=a.top_p,
                              top_k=a.top_k, max_new_tokens=a.max_new_tokens, sglang_tp=a.sglang_tp,
                              sglang_mem_fraction=a.sglang_mem_fraction),
        data=DataConfig(eval_files=tuple(a.data), schema=a.schema, apply_chat_template=not a.no_chat_template,
                        max_prompt_tokens=a.max_prompt_tokens),
        reward=RewardConfig(fn=a.reward, correct_score=a.correct_score, incorrect_score=a.incorrect_score,
                            timeout_s=a.reward_timeout),
        trainer=TrainerConfig(seed=a.seed, deterministic=a.deterministic),
    )


def load_checkpoint_into(engine, cfg, model: ModelSource, hf_cfg: dict) -> None:
    """Collective: the actor checkpoint into a Megatron model at this run's TP/PP, then into the
    engines by the trainer's weight sync (full HF tensors, bounded buckets). The Megatron model
    is dropped afterwards."""
    import gc

    import model_providers
    from model_providers.build import build_chunks
    from vapo_megatron import checkpoint_io, parallel
    from vapo_megatron.rollout.weight_sync import sync_weights
    from vapo_megatron.run_state import param_dtype

    parallel.validate_layout(parallel.launcher_env()[1], cfg.parallel.tp, cfg.parallel.pp, num_layers=hf_cfg["num_hidden_layers"],
                             num_attention_heads=hf_cfg["num_attention_heads"],
                             num_query_groups=hf_cfg.get("num_key_value_heads", hf_cfg["num_attention_heads"]), prefix="--")
    chunks = build_chunks(hf_cfg, params_dtype=param_dtype(cfg), critic=False)
    checkpoint_io.load_model(model.checkpoint, chunks)
    sync_weights(chunks, model_providers.family_for(hf_cfg), hf_cfg, engine, version=0,
                 bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20)
    del chunks
    gc.collect()


def run(a: argparse.Namespace, ks: list[int]) -> dict | None:
    """Collective. Returns the summary on global rank 0."""
    from transformers import AutoTokenizer

    import model_providers
    from vapo_megatron import parallel
    from vapo_megatron.data.prompts import load_prompts
    from vapo_megatron.rewards import build_reward_fn
    from vapo_megatron.rewards.answers import AnswerKey
    from vapo_megatron.rollout_collect import RolloutContext, _build_engine, evaluate, generating_ranks
    from vapo_megatron.sampled_eval import sample_eval

    model = resolve_model(a.model)
    cfg = build_config(a, model)
    hf_cfg = model_providers.load_hf_config(cfg.model.hf_path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    records, stats = load_prompts(list(a.data), tokenizer, max_prompt_tokens=a.max_prompt_tokens,
                                  apply_chat_template=not a.no_chat_template, schema=a.schema)
    records = records[: a.max_prompts] if a.max_prompts else records
    parallel.init_distributed(cfg.parallel.tp, cfg.parallel.pp, seed=a.seed)  # after the cheap checks
    reward_fn = build_reward_fn(a.reward, correct_score=a.correct_score, incorrect_score=a.incorrect_score, timeout_s=a.reward_timeout)
    engine = _build_engine(cfg, with_weights=model.checkpoint is None)
    if model.checkpoint is not None:
        load_checkpoint_into(engine, cfg, model, hf_cfg)
    stops = tuple(dict.fromkeys(t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None))
    ctx = RolloutContext(cfg, hf_cfg, tokenizer, [], records, reward_fn, engine, stops,
                         generators=generating_ranks(engine), answers=AnswerKey(a.reward, timeout_s=a.reward_timeout))
    try:
        result = sample_eval(ctx, records, n=a.n_samples, temperature=a.temperature, seed=a.seed)
        greedy = evaluate(ctx, records) if a.greedy else None
    finally:
        ctx.close()
        reward_fn.close()
    if result is None:
        return None
    summary = _summary(result, ks, greedy, a, model, skipped=sum(stats.skipped.values()))
    write_outputs(Path(a.out), result, summary, ks)
    return summary


def _summary(result, ks: list[int], greedy: float | None, a, model: ModelSource, *, skipped: int) -> dict:
    from vapo_megatron.eval_metrics import pass_at_k

    n = a.n_samples
    by_prompt = [result.rows[i * n : (i + 1) * n] for i in range(len(result.votes))]
    figures = {f"avg@{n}": result.summary[f"avg@{n}"]}
    for k in ks:  # the ladder is in result.summary; --pass-k may ask for others
        figures[f"pass@{k}"] = sum(pass_at_k(n, sum(r.correct for r in g), k) for g in by_prompt) / len(by_prompt)
    figures[f"maj@{n}"] = result.summary[f"maj@{n}"]
    if greedy is not None:
        figures["greedy_accuracy"] = greedy
    figures |= {k: v for k, v in result.summary.items() if k.startswith("response_length/")}
    return figures | {
        "prompts": len(by_prompt), "samples_per_prompt": n, "prompts_skipped": skipped,
        "model": str(a.model), "checkpoint": model.checkpoint is not None, "data": list(a.data),
        "reward": a.reward, "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
        "max_new_tokens": a.max_new_tokens, "seed": a.seed,
    }


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)


def write_outputs(out: Path, result, summary: dict, ks: list[int]) -> None:
    from vapo_megatron.eval_metrics import pass_at_k
    from vapo_megatron.sampled_eval import row_dict

    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "samples.jsonl", "".join(json.dumps(row_dict(r)) + "\n" for r in result.rows))
    n = summary["samples_per_prompt"]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["prompt_index", "source", "ground_truth", "samples", "correct", "accuracy",
                *[f"pass@{k}" for k in ks], "maj_answer", "maj_votes", "maj_correct", "mean_length", "truncated"])
    for i, vote in enumerate(result.votes):
        g = result.rows[i * n : (i + 1) * n]
        c = sum(r.correct for r in g)
        w.writerow([i, g[0].source, g[0].ground_truth, n, c, f"{c / n:.4f}", *[f"{pass_at_k(n, c, k):.4f}" for k in ks],
                    vote.answer or "", vote.votes, vote.correct, f"{sum(r.length for r in g) / n:.2f}",
                    sum(r.truncated for r in g)])
    _write_atomic(out / "per_prompt.csv", buf.getvalue())
    _write_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")


def format_summary(s: dict) -> str:
    lines = [f"vapo-eval: {s['prompts']} prompts x {s['samples_per_prompt']} samples, temperature {s['temperature']:g}, "
             f"seed {s['seed']}, model {s['model']}"]
    for k, v in s.items():
        if "@" in k or k == "greedy_accuracy":
            lines.append(f"{k:<16} {v:.4f}")
    lines.append(f"{'length':<16} mean {s['response_length/mean']:.1f}, max {s['response_length/max']:.0f}, "
                 f"truncated {s['response_length/clip_ratio']:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vapo_megatron import parallel
    from vapo_megatron.checkpoint_io import CheckpointError
    from vapo_megatron.data.prompts import PromptDataError
    from vapo_megatron.parallel import LayoutError

    args = parse_args(argv)
    try:
        ks = check_args(args)
        resolve_model(args.model)
    except EvalInputError as e:
        print(f"vapo-eval: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        summary = run(args, ks)
    except (EvalInputError, PromptDataError, CheckpointError, LayoutError, ValueError) as e:
        kind = {PromptDataError: "data error: ", CheckpointError: "checkpoint error: "}.get(type(e), "")
        print(f"vapo-eval: {kind}{str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    finally:
        parallel.destroy()
    if summary is not None:
        print(format_summary(summary), flush=True)
        print(f"vapo-eval: wrote {Path(args.out) / 'samples.jsonl'}, per_prompt.csv, summary.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
