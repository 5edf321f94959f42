#!/usr/bin/env python3
"""Plot a run's main curves: scripts/plot_metrics.py RUN_DIR [--out FILE.png]

Reads RUN_DIR/metrics.jsonl and writes RUN_DIR/curves.png (reward, response length, entropy,
value loss, explained variance, eval accuracy), marking where each phase starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [
    ("reward/mean", "reward (mean)"),
    ("response_length/mean", "response length (tokens)"),
    ("actor/entropy", "entropy"),
    ("critic/value_loss", "value loss"),
    ("critic/explained_variance", "explained variance"),
    ("eval/accuracy", "held-out accuracy (greedy)"),
]


def read_metrics(path: str) -> list[dict]:
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{lineno}: not valid JSON ({e})")
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    path = os.path.join(args.run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        print(f"plot_metrics: {path} not found", file=sys.stderr)
        return 1
    records = read_metrics(path)
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for phase, style in (("value_pretrain", "C1."), ("vapo", "C0-"), ("eval", "C2o-")):
            pts = [(r["step"], r[key]) for r in records if r.get("phase") == phase and r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style, label=phase, markersize=4)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out = args.out or os.path.join(args.run_dir, "curves.png")
    fig.savefig(out, dpi=90)
    print(f"plot_metrics: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
