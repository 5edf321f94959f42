"""vapo-eval: avg@K, pass@k and maj@K of a model on held-out prompts, as the paper reports them.

    vapo-eval --model DIR --data FILE [FILE ...] --n-samples K --out OUT_DIR [--reward math]
    torchrun --nproc-per-node N -m vapo_megatron.eval --model DIR ...   (prompts split over ranks)

--model is a Hugging Face model directory or a trainer checkpoint: the actor directory
(run_dir/checkpoints/iter_N/actor) or the iteration directory holding it. Sampling, rewards and
engines are the trainer's (vapo_megatron/evaluation/), so the figures match the periodic
eval/avg@K of a run. Writes OUT_DIR/samples.jsonl (one object per sample), OUT_DIR/per_prompt.csv
and OUT_DIR/summary.json, and prints the same figures.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from vapo_megatron.config.engines import ENGINES
from vapo_megatron.evaluation.offline import EvalInputError, resolve_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vapo-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory, or trainer checkpoint (iter_N or iter_N/actor)")
    p.add_argument("--data", required=True, nargs="+", help="eval files (.jsonl/.parquet; simple or dapo schema)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--n-samples", type=int, default=32, help="K samples per prompt (default 32, the paper's avg@32)")
    p.add_argument("--pass-k", type=int, nargs="+", default=None, help="k for pass@k (default 1, 2, 4, ..., K)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (default 1.0, the training temperature)")
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
    # The engines of this command's own processes (config/engines.py; a server engine is the trainer's).
    engines = [name for name, e in ENGINES.items() if not e.remote]
    p.add_argument("--engine", choices=engines, default="embedded", help="embedded (CPU/one GPU) or colocated SGLang")
    p.add_argument("--sglang-tp", type=int, default=1)
    p.add_argument("--sglang-mem-fraction", type=float, default=0.8)
    p.add_argument("--sglang-max-total-tokens", type=int, default=None,
                   help="cap on SGLang's KV cache, in tokens (default: what --sglang-mem-fraction gives)")
    p.add_argument("--deterministic", action="store_true", help="SGLang deterministic inference: only then does SGLang "
                   "honour the per-sample seeds (slower); the embedded engine always does")
    p.add_argument("--tp", type=int, default=1, help="Megatron TP for loading a checkpoint (ranks = tp * pp * dp)")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="default: bfloat16 on GPU, float32 on CPU")
    return p.parse_args(argv)


def check_args(a: argparse.Namespace) -> list[int]:
    """Everything checkable before a model is built; returns the pass@k ladder. Every number is
    finite (argparse's float takes nan and inf) and in its range; each message names the flag."""
    import math

    from vapo_megatron.evaluation.metrics import k_ladder

    if a.n_samples < 1:
        raise EvalInputError(f"--n-samples {a.n_samples}: must be >= 1")
    ks = a.pass_k or k_ladder(a.n_samples)
    for k in ks:
        if not 1 <= k <= a.n_samples:
            raise EvalInputError(f"--pass-k {k}: pass@k needs 1 <= k <= --n-samples ({a.n_samples})")
    if not (math.isfinite(a.temperature) and a.temperature > 0):
        raise EvalInputError(f"--temperature {a.temperature}: must be a finite number > 0 "
                             "(use --greedy for greedy accuracy)")
    if not 0 < a.top_p <= 1:
        raise EvalInputError(f"--top-p {a.top_p}: must be in (0, 1]")
    if not (a.top_k == -1 or a.top_k >= 1):
        raise EvalInputError(f"--top-k {a.top_k}: must be -1 (off) or >= 1")
    if a.max_new_tokens < 1 or a.max_prompt_tokens < 1:
        raise EvalInputError("--max-new-tokens and --max-prompt-tokens must be >= 1")
    if a.max_prompts is not None and a.max_prompts < 1:
        raise EvalInputError(f"--max-prompts {a.max_prompts}: must be >= 1")
    if not (a.reward in ("math", "exact") or a.reward.count(":") == 1):
        raise EvalInputError(f"--reward {a.reward!r}: must be math, exact or package.module:function")
    for flag, value in (("--correct-score", a.correct_score), ("--incorrect-score", a.incorrect_score)):
        if not math.isfinite(value):
            raise EvalInputError(f"{flag} {value}: must be a finite number")
    if a.correct_score <= a.incorrect_score:
        raise EvalInputError("--correct-score must be greater than --incorrect-score")
    if not (math.isfinite(a.reward_timeout) and a.reward_timeout > 0):
        raise EvalInputError(f"--reward-timeout {a.reward_timeout}: must be a finite number of seconds > 0")
    if a.sglang_tp < 1:
        raise EvalInputError(f"--sglang-tp {a.sglang_tp}: must be >= 1")
    if not 0 < a.sglang_mem_fraction < 1:
        raise EvalInputError(f"--sglang-mem-fraction {a.sglang_mem_fraction}: must be in (0, 1)")
    if a.sglang_max_total_tokens is not None and a.sglang_max_total_tokens < 1:
        raise EvalInputError(f"--sglang-max-total-tokens {a.sglang_max_total_tokens}: must be >= 1")
    for f in a.data:
        if not os.path.isfile(f):
            raise EvalInputError(f"--data {f}: no such file")
    return sorted(set(ks))


def format_summary(s: dict) -> str:
    lines = [f"vapo-eval: {s['prompts']} prompts x {s['samples_per_prompt']} samples, "
             f"temperature {s['temperature']:g}, seed {s['seed']}, model {s['model']}"]
    for k, v in s.items():
        if "@" in k or k == "greedy_accuracy":
            lines.append(f"{k:<16} {v:.4f}")
    lines.append(f"{'length':<16} mean {s['response_length/mean']:.1f}, max {s['response_length/max']:.0f}, "
                 f"truncated {s['response_length/clip_ratio']:.4f}")
    return "\n".join(lines)


def evaluate(args: argparse.Namespace) -> int:
    """The checks that need no model, then the collective run; prints the figures on rank 0."""
    from vapo_megatron.runtime.atomic import EVAL_OUTPUT, check_replaceable

    ks = check_args(args)
    model = resolve_model(args.model)  # its tokenizer, template and generation config loaded once
    # Its files replace only an earlier vapo-eval's: never a user's directory or the model; and the
    # directory takes new files (an empty read-only --out once failed after the whole evaluation).
    check_replaceable(args.out, EVAL_OUTPUT, overwrite=True, flag=None, sources={"--model": args.model}, in_place=True)
    import torch

    from vapo_megatron.config import problems_error
    from vapo_megatron.config.preflight import hardware_problems
    from vapo_megatron.config.quiet import device_startup
    from vapo_megatron.evaluation.offline import build_config, run
    from vapo_megatron.mcore import parallel

    problems = hardware_problems(build_config(args, model), cuda=torch.cuda.is_available(), engine_flag="--engine",
                                 deterministic_flag="--deterministic")
    if problems:  # vapo-train's check (--engine sglang without CUDA, --deterministic with SGLang's CPU engine)
        raise problems_error(problems)
    device_startup()

    try:
        summary = run(args, ks, model)
    finally:
        parallel.destroy()
    if summary is not None:
        print(format_summary(summary), flush=True)
        print(f"vapo-eval: wrote {Path(args.out) / 'samples.jsonl'}, per_prompt.csv, summary.json", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from vapo_megatron.config.cli import answer
    from vapo_megatron.config.quiet import quiet_startup

    quiet_startup()
    args = parse_args(argv)
    return answer("vapo-eval", lambda: evaluate(args), bad_input=bad_input_errors())


def bad_input_errors() -> tuple[type[BaseException], ...]:
    """What a wrong flag, file, model or checkpoint raises; every message names it. ValueError:
    libraries reading a damaged file (a JSON error in metadata.json, a bad safetensors header)."""
    from model_providers import HFConfigError
    from vapo_megatron.checkpoint.dist_io import CheckpointError
    from vapo_megatron.config import ConfigError
    from vapo_megatron.data.prompts import PromptDataError

    return EvalInputError, PromptDataError, CheckpointError, ConfigError, HFConfigError, ValueError


if __name__ == "__main__":
    sys.exit(main())
