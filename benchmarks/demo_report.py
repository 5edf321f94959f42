#!/usr/bin/env python3
"""Summarize a demo run: held-out greedy accuracy before and after VAPO, where the time went, and
a sample generation from the exported HF model. Exits non-zero only when the demo did not learn
(accuracy gain < 0.20): the wall time depends on the machine and its load, so it is reported
(with each phase's share of the steps), never judged; a run that learned on a slow machine passes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MIN_GAIN = 0.20
# perf/<phase>_s of every RL step (vapo_megatron/trainer/timing.py's PHASES, and what no phase holds).
PHASES = ("rollout", "reward", "score", "critic_update", "actor_update", "sync", "eval", "checkpoint", "other")
README_SECONDS = 600  # the README's figure for an idle 2-core machine: context, not a target


def phase_split(records: list[dict]) -> tuple[float, int, list[tuple[str, float]]]:
    """(seconds of all RL steps, their count, [(phase, seconds)] largest first) from perf/*."""
    steps = [r for r in records if r.get("phase") in ("vapo", "value_pretrain") and r.get("perf/step_s") is not None]
    total = sum(r["perf/step_s"] for r in steps)
    spent = {p: sum(r.get(f"perf/{p}_s") or 0.0 for r in steps) for p in PHASES}
    return total, len(steps), sorted(((p, s) for p, s in spent.items() if s > 0), key=lambda x: -x[1])


def sample_answer(hf_dir: Path) -> str | None:
    if not (hf_dir / "config.json").is_file():
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "38+47="}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=6, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--seconds", type=float, default=None, help="wall time of the whole demo (reported only)")
    args = ap.parse_args(argv)
    records = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    before = next(r["eval/accuracy"] for r in records if "eval/accuracy_before_vapo" in r)
    after = [r["eval/accuracy"] for r in records if "eval/accuracy_final" in r][-1]
    gain = after - before
    print(f"demo: held-out greedy accuracy before VAPO {before:.3f}, after VAPO {after:.3f} (gain {gain:+.3f})")
    answer = sample_answer(args.run_dir / "hf")
    if answer is not None:
        print(f"demo: exported model ({args.run_dir / 'hf'}) answers 38+47= with {answer!r}")
    total, n, split = phase_split(records)
    if args.seconds is not None:
        note = f" (the README quotes about {README_SECONDS} s on an idle 2-core machine; time is not a target)" \
            if args.seconds > README_SECONDS else ""
        print(f"demo: wall time {args.seconds:.0f} s{note}")
    if n:
        shares = ", ".join(f"{p} {100 * s / total:.0f}%" for p, s in split)
        print(f"demo: {n} RL steps took {total:.0f} s ({total / n:.2f} s each): {shares}")
    ok = gain >= MIN_GAIN
    print("demo: learned (targets met)" if ok
          else f"demo: targets NOT met (accuracy gain {gain:+.3f} < {MIN_GAIN:.2f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
