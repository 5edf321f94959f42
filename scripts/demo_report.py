#!/usr/bin/env python3
"""Summarize a demo run: held-out greedy accuracy before and after VAPO, wall time, and a
sample generation from the exported HF model. Exits non-zero if the demo's targets are missed
(accuracy gain >= 0.20, wall time <= 600 s)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--seconds", type=float, default=None, help="wall time of the whole demo")
    args = ap.parse_args(argv)
    records = [json.loads(l) for l in (args.run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    before = next(r["eval/accuracy"] for r in records if "eval/accuracy_before_vapo" in r)
    after = [r["eval/accuracy"] for r in records if "eval/accuracy_final" in r][-1]
    print(f"demo: held-out greedy accuracy before VAPO {before:.3f}, after VAPO {after:.3f} (gain {after - before:+.3f})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.run_dir / "hf")
    model = AutoModelForCausalLM.from_pretrained(args.run_dir / "hf")
    ids = tok.apply_chat_template([{"role": "user", "content": "38+47="}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=6, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"demo: exported model ({args.run_dir / 'hf'}) answers 38+47= with {answer!r}")
    ok = after - before >= 0.20
    if args.seconds is not None:
        print(f"demo: wall time {args.seconds:.0f} s")
        ok = ok and args.seconds <= 600
    print("demo: targets met" if ok else "demo: targets NOT met (gain >= 0.20 and <= 600 s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
