"""vapo-eval's library part: a model (HF directory or trainer checkpoint) evaluated on prompt files.

    source = resolve_model(path)          an HF directory, or a trainer / vapo-convert checkpoint
    summary = run(args, ks, source)       collective; the figures on global rank 0
    write_outputs(out, result, summary)   samples.jsonl, per_prompt.csv, summary.json (atomic)

A checkpoint's weights are loaded into a Megatron model and streamed into the rollout engine by
the trainer's own weight sync. Sampling, rewards and engines are the trainer's (sampled.py), so
the figures match the periodic eval/avg@K of a run. `args` are vapo-eval's parsed arguments
(vapo_megatron/eval.py).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from vapo_megatron.runtime.atomic import EVAL_OUTPUT, mark, write_atomic


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
        return ModelSource(hf_dir=_checked(p, weights=True, arg=path), checkpoint=None)
    if (p / "metadata.json").exists() or (p / "vapo.json").exists():
        for need in ("metadata.json", "vapo.json", "hf/config.json"):
            if not (p / need).is_file():
                raise EvalInputError(f"--model {p}: unreadable checkpoint: {p / need} is missing")
        from vapo_megatron.checkpoint.dist_io import CheckpointError, require_checkpoint

        try:
            require_checkpoint(p)
        except CheckpointError as e:
            raise EvalInputError(f"--model {p}: unreadable checkpoint: {e}") from None
        except ValueError as e:  # megatron's check parses metadata.json and lets a JSON error through
            raise EvalInputError(f"--model {p}: unreadable checkpoint: {p / 'metadata.json'}: "
                                 f"{type(e).__name__}: {e}") from None
        try:
            critic = json.loads((p / "vapo.json").read_text())["critic"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise EvalInputError(f"--model {p}: unreadable checkpoint: {p / 'vapo.json'} "
                                 f"({type(e).__name__}: {e})") from None
        if critic:
            raise EvalInputError(f"--model {p}: a critic checkpoint; give the actor's (iter_N/actor)")
        return ModelSource(hf_dir=_checked(p / "hf", weights=False, arg=path), checkpoint=p)
    raise EvalInputError(f"--model {path}: neither a Hugging Face model directory (config.json and *.safetensors) "
                         "nor a trainer checkpoint (iter_N or iter_N/actor: metadata.json, vapo.json, hf/)")


def _checked(hf_dir: Path, *, weights: bool, arg: str) -> Path:
    """The checks every command makes of a model directory before work starts: a family the
    trainer supports (the same check as vapo-train's and vapo-convert's), whole files, and the
    tokenizer, chat template and generation config loaded (data/model_files.py)."""
    from model_providers import HFConfigError, check_supported, read_hf_config
    from model_providers.files import model_dir_problems
    from vapo_megatron.data.model_files import loading_problems

    try:
        check_supported(read_hf_config(hf_dir))
    except HFConfigError as e:
        raise EvalInputError(f"--model {arg}: {e}") from None
    problems = model_dir_problems(hf_dir, weights=weights)
    problems = problems or loading_problems(hf_dir)  # whole files, then loaded
    if problems:
        raise EvalInputError(f"--model {arg}: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return hf_dir


def build_config(a: argparse.Namespace, model: ModelSource):
    """The trainer's Config for the pieces it shares with vapo-eval (engine, sampling, reward)."""
    import torch

    from vapo_megatron.config import (
        Config,
        DataConfig,
        ModelConfig,
        ParallelConfig,
        RewardConfig,
        RolloutConfig,
        SGLangConfig,
        TrainerConfig,
    )

    dtype = a.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    return Config(
        model=ModelConfig(hf_path=str(model.hf_dir), dtype=dtype),
        parallel=ParallelConfig(tp=a.tp, pp=a.pp),
        rollout=RolloutConfig(engine=a.engine, n_samples=a.n_samples, temperature=a.temperature, top_p=a.top_p,
                              top_k=a.top_k, max_new_tokens=a.max_new_tokens,
                              sglang=SGLangConfig(tp=a.sglang_tp, mem_fraction=a.sglang_mem_fraction,
                                                  max_total_tokens=a.sglang_max_total_tokens)),
        data=DataConfig(eval_files=tuple(a.data), schema=a.schema, apply_chat_template=not a.no_chat_template,
                        max_prompt_tokens=a.max_prompt_tokens),
        reward=RewardConfig(fn=a.reward, correct_score=a.correct_score, incorrect_score=a.incorrect_score,
                            timeout_s=a.reward_timeout),
        trainer=TrainerConfig(seed=a.seed, deterministic=a.deterministic),
    )


def load_checkpoint_into(gen, cfg, model: ModelSource, hf_cfg: dict) -> None:
    """Collective: the actor checkpoint into a Megatron model at this run's TP/PP, then into the
    engines by the trainer's weight sync (full HF tensors, bounded buckets). The Megatron model
    is dropped afterwards."""
    import gc

    from model_providers import family_for
    from vapo_megatron.checkpoint import dist_io
    from vapo_megatron.mcore.dtypes import torch_dtype
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.rollout.weight_sync import stream_weights

    chunks = build_chunks(hf_cfg, params_dtype=torch_dtype(cfg.model.dtype), critic=False)
    dist_io.load_model(model.checkpoint, chunks)
    stream_weights(chunks, family_for(hf_cfg), hf_cfg, gen.engine, version=0,
                 bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20)
    del chunks
    gc.collect()


def run(a: argparse.Namespace, ks: list[int], model: ModelSource | None = None) -> dict | None:
    """Collective. Returns the summary on global rank 0. `model`: resolve_model(a.model), when the
    caller has it (its checks are not repeated)."""
    from model_providers import read_hf_config
    from vapo_megatron.config.layout import CLI_KEYS, check_layout
    from vapo_megatron.data.datasets import load_tokenizer, stop_token_ids
    from vapo_megatron.data.prompts import load_prompts
    from vapo_megatron.evaluation.sampled import greedy_accuracy, sample_eval
    from vapo_megatron.mcore import parallel
    from vapo_megatron.rewards import build_reward_fn
    from vapo_megatron.rewards.answers import AnswerKey
    from vapo_megatron.rewards.scorer import Scorer
    from vapo_megatron.rollout.generator import Generator

    model = model or resolve_model(a.model)
    cfg = build_config(a, model)
    hf_cfg = read_hf_config(cfg.model.hf_path)
    check_layout(parallel.launcher_env()[1], a.tp, a.pp, model=hf_cfg, model_key=f"--model {a.model}", keys=CLI_KEYS)
    tokenizer = load_tokenizer(cfg.model.hf_path, hf_cfg["vocab_size"], hf_cfg["_source"])
    records, stats = load_prompts(list(a.data), tokenizer, max_prompt_tokens=a.max_prompt_tokens,
                                  apply_chat_template=not a.no_chat_template, schema=a.schema, schema_key="--schema")
    records = records[: a.max_prompts] if a.max_prompts else records
    parallel.init_distributed(cfg.parallel.tp, cfg.parallel.pp, seed=a.seed,  # after the cheap checks
                             wait_timeout_s=cfg.rollout.wait_timeout_s)
    scorer = Scorer(build_reward_fn(a.reward, correct_score=a.correct_score, incorrect_score=a.incorrect_score,
                                    timeout_s=a.reward_timeout), tokenizer, stop_token_ids(tokenizer))
    answers = AnswerKey(a.reward, timeout_s=a.reward_timeout)
    # An HF model's engines serve its own weights; a checkpoint's get them by the sync below.
    gen = Generator.build(cfg, scorer.stop_token_ids, with_weights=model.checkpoint is None,
                          synced=model.checkpoint is not None)
    try:
        if model.checkpoint is not None:
            load_checkpoint_into(gen, cfg, model, hf_cfg)
        result = sample_eval(gen, scorer, answers, records, n=a.n_samples, temperature=a.temperature, seed=a.seed)
        greedy = greedy_accuracy(gen, scorer, records) if a.greedy else None
    finally:
        gen.close()
        answers.close()
        scorer.close()
    if result is None:
        return None
    summary = _summary(result, ks, greedy, a, model, skipped=sum(stats.skipped.values()))
    write_outputs(Path(a.out), result, summary, ks)
    return summary


def _summary(result, ks: list[int], greedy: float | None, a, model: ModelSource, *, skipped: int) -> dict:
    from vapo_megatron.evaluation.metrics import pass_at_k

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


def write_outputs(out: Path, result, summary: dict, ks: list[int]) -> None:
    from vapo_megatron.evaluation.metrics import pass_at_k
    from vapo_megatron.evaluation.sampled import row_dict

    out.mkdir(parents=True, exist_ok=True)
    mark(out, EVAL_OUTPUT)  # a later vapo-eval may replace these files; no other writer may
    write_atomic(out / "samples.jsonl", "".join(json.dumps(row_dict(r)) + "\n" for r in result.rows))
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
    write_atomic(out / "per_prompt.csv", buf.getvalue())
    write_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")


__all__ = ["EvalInputError", "ModelSource", "build_config", "resolve_model", "run", "write_outputs"]
