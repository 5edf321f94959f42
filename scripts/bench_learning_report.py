"""The table and figure of scripts/bench_learning.py (its runs' summary.json files; issue 31).

    table(summaries)          markdown: per variant, mean ± std [min, max] over seeds of each column
    figure(summaries, path)   PNG: held-out greedy accuracy vs RL step, mean and min-max band per variant
"""

from __future__ import annotations

import statistics
from pathlib import Path

COLUMNS = ("accuracy", "avg@K", "short_accuracy", "short_avg@K", "long_accuracy", "long_avg@K", "wall_s")


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    m = statistics.fmean(values)
    if len(values) == 1:
        return f"{m:.3f}" if m < 10 else f"{m:.0f}"
    sd = statistics.stdev(values)
    fmt = ".3f" if m < 10 else ".0f"
    return f"{m:{fmt}} ± {sd:{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def table(summaries: list[dict]) -> str:
    rows = ["| variant | seeds | samples | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 3)]
    for v in dict.fromkeys(s["variant"] for s in summaries):
        done = [s for s in summaries if s["variant"] == v and s["status"] == "finished"]
        failed = [s for s in summaries if s["variant"] == v and s["status"] != "finished"]
        seeds = ",".join(str(s["seed"]) for s in done) + (f" ({len(failed)} failed)" if failed else "")
        if not done:
            need = failed[0].get("needs")
            rows.append(f"| {v} | {seeds} | - | failed" + (f" (needs {need})" if need else "") + " |" + " |" * (len(COLUMNS) - 1))
            continue
        cells = [spread([s[c] for s in done if s.get(c) is not None]) for c in COLUMNS]
        rows.append(f"| {v} | {seeds} | {done[0]['samples']} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def figure(summaries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for v in dict.fromkeys(s["variant"] for s in summaries):
        curves = [dict(map(tuple, s["curve"])) for s in summaries if s["variant"] == v and s["status"] == "finished"]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        ys = [[c[x] for c in curves] for x in steps]
        ax.plot(steps, [statistics.fmean(y) for y in ys], label=f"{v} (n={len(curves)})")
        ax.fill_between(steps, [min(y) for y in ys], [max(y) for y in ys], alpha=0.2)
    ax.set_xlabel("RL step (value pretraining's included)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


