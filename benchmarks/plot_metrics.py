#!/usr/bin/env python3
"""Plot a run's main curves: python -m benchmarks.plot_metrics RUN_DIR [--out FILE.png]

Reads RUN_DIR/metrics.jsonl and writes RUN_DIR/curves.png (reward, response length, entropy,
value loss, explained variance, eval accuracy: those the run logged, so a run without a critic
has no value panels), marking where each phase starts, the sampled held-out figures users report
(eval/avg@K, the largest eval/pass@k, eval/maj@K; docs/evaluation.md), and a stacked panel of each
training step's wall time by phase (perf/<phase>_s, vapo_megatron/trainer/timing.py). The RL
steps are labelled by the run's estimator (RUN_DIR/config.yaml: vapo, or grpo).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import matplotlib
import yaml

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


TIME_PHASES = ["rollout", "reward", "score", "critic_update", "actor_update", "sync", "eval", "checkpoint", "other"]


def plot_time_split(ax, records: list[dict]) -> None:
    """Stacked seconds per phase for every training step that logged them (perf/*_s)."""
    steps = [r for r in records if r.get("phase") in ("value_pretrain", "vapo") and r.get("perf/step_s") is not None]
    phases = [p for p in TIME_PHASES if any(r.get(f"perf/{p}_s") for r in steps)]
    if steps and phases:
        xs = [r["step"] for r in steps]
        ax.stackplot(xs, *[[r.get(f"perf/{p}_s") or 0.0 for r in steps] for p in phases], labels=phases, alpha=0.85)
        ax.legend(fontsize=6, loc="upper left", ncol=2)
    ax.set_title("time per step by phase (s)")
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)


def sampled_eval_keys(records: list[dict]) -> list[str]:
    """eval/avg@K, the largest eval/pass@k and eval/maj@K, as logged (K is the config's eval.n_samples)."""
    found: dict[str, tuple[int, str]] = {}
    for r in records:
        for key in r:
            m = re.fullmatch(r"eval/(avg|pass|maj)@(\d+)", key)
            if m and (m[1] not in found or int(m[2]) > found[m[1]][0]):
                found[m[1]] = (int(m[2]), key)
    return [found[kind][1] for kind in ("avg", "pass", "maj") if kind in found]


def plot_sampled_eval(ax, records: list[dict]) -> None:
    for key in sampled_eval_keys(records):
        pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if not pts:  # logged only as null
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, "o-", label=key.removeprefix("eval/"), markersize=4)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.set_title("held-out, sampled at the eval temperature")
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)


def rl_label(run_dir: str) -> str:
    """What the RL steps (phase "vapo" in metrics.jsonl) are called in the legend: the run's
    algo.estimator as its config.yaml says, "grpo" for GRPO and "vapo" for GAE (and without one)."""
    try:
        with open(os.path.join(run_dir, "config.yaml")) as f:
            estimator = (yaml.safe_load(f) or {}).get("algo", {}).get("estimator", "gae")
    except (OSError, yaml.YAMLError, AttributeError):
        estimator = "gae"
    return "grpo" if estimator == "grpo" else "vapo"


def panels(records: list[dict]) -> list[tuple[str, str]]:
    """PANELS the run logged at least one value of (no critic: no value loss, no explained variance)."""
    return [(key, title) for key, title in PANELS if any(r.get(key) is not None for r in records)]


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
    shown = panels(records)
    rows = math.ceil((len(shown) + 2) / 4)  # + the sampled eval and the time split
    fig, axes = plt.subplots(rows, 4, figsize=(18, 3.5 * rows), squeeze=False)
    labels = {"value_pretrain": "value_pretrain", "vapo": rl_label(args.run_dir), "eval": "eval"}
    for ax, (key, title) in zip(axes.flat, shown):
        for phase, style in (("value_pretrain", "C1."), ("vapo", "C0-"), ("eval", "C2o-")):
            pts = [(r["step"], r[key]) for r in records if r.get("phase") == phase and r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style, label=labels[phase], markersize=4)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    plot_sampled_eval(axes.flat[len(shown)], records)
    plot_time_split(axes.flat[len(shown) + 1], records)
    for ax in list(axes.flat)[len(shown) + 2:]:
        ax.set_visible(False)
    fig.tight_layout()
    out = args.out or os.path.join(args.run_dir, "curves.png")
    fig.savefig(out, dpi=90)
    print(f"plot_metrics: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
