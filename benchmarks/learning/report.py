"""The tables and figures of the learning benchmark (its runs' summary.json files; issues 31 and 45).

    table(summaries)               markdown: per variant, mean ± std [min, max] over seeds of each column
    figure(summaries, path)        PNG: held-out greedy accuracy vs RL step, mean and min-max band per variant
    t_interval(values)             mean and 95% t-interval
    study_report(summaries, ...)   a study's markdown: its arms, and the paired differences by warm start
    decisions(summaries, study)    the critic study's pre-registered decision rules 1-5, applied (markdown)
    holm_tables(...)               a study's primary pairs under Holm's correction; its secondary pairs
    oracle_decisions(done, study)  the positive control's pre-registered decision rules (issue 54)
    single_decisions(done, study)  the one-answer-per-prompt study's pre-registered decision rules (issue 66)
    seed_figure(summaries, ...)    PNG: one panel per arm, one line per seed, held-out accuracy vs RL step
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.learning.stats import fieller, holm, t_test

# issue 31's summaries
COLUMNS = ("accuracy", "avg@K", "short_accuracy", "short_avg@K", "long_accuracy", "long_avg@K", "wall_s")
STUDY_COLUMNS = ("heldout_avg@K", "long_avg@K", "heldout_accuracy", "auc", "short_avg@K", "samples_generated", "cpu_s")
ENDPOINTS = (("heldout_avg@K", "primary: avg@K on all held-out prompts"), ("long_avg@K", "avg@K on long chains"),
             ("heldout_accuracy", "greedy accuracy on all held-out prompts"), ("auc", "area under the held-out curve"))
# t(0.975, df) for df = 1..30 (a two-sided 95% interval); above 30 the table's last value, a bound.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    m = statistics.fmean(values)
    if len(values) == 1:
        return f"{m:.3f}" if m < 10 else f"{m:.0f}"
    sd = statistics.stdev(values)
    fmt = ".3f" if m < 10 else ".0f"
    return f"{m:{fmt}} ± {sd:{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def table(summaries: list[dict], columns: tuple[str, ...] = COLUMNS) -> str:
    rows = ["| variant | seeds | samples | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 3)]
    for v in dict.fromkeys(s["variant"] for s in summaries):
        done = [s for s in summaries if s["variant"] == v and s["status"] == "finished"]
        failed = [s for s in summaries if s["variant"] == v and s["status"] == "failed"]
        seeds = ",".join(str(s["seed"]) for s in done) + (f" ({len(failed)} failed)" if failed else "")
        if not done:
            need = failed[0].get("needs") if failed else None
            rows.append(f"| {v} | {seeds} | - | {'failed' if failed else 'not run'}"
                        + (f" (needs {need})" if need else "")
                        + " |" + " |" * (len(columns) - 1))
            continue
        cells = [spread([s[c] for s in done if s.get(c) is not None]) for c in columns]
        trained = [s["samples"] for s in done]  # one figure, or a spread (partial rollout's can differ)
        samples = str(trained[0]) if len(set(trained)) == 1 else spread(trained)
        rows.append(f"| {v} | {seeds} | {samples} | " + " | ".join(cells) + " |")
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




def t_interval(values: list[float]) -> tuple[float, float, float] | None:
    """(mean, low, high): mean ± t(0.975, n-1) x sd / sqrt(n); None for fewer than 2 values."""
    n = len(values)
    if n < 2:
        return None
    m = statistics.fmean(values)
    half = T975[min(n - 1, len(T975)) - 1] * statistics.stdev(values) / n ** 0.5
    return m, m - half, m + half


def paired(summaries: list[dict], a: str, b: str, key: str) -> dict[int, float]:
    """{seed: a - b} over the seeds where both arms finished with a value of `key`."""
    by = {(s["variant"], s["seed"]): s.get(key) for s in summaries if s["status"] == "finished"}
    return {seed: by[(a, seed)] - by[(b, seed)] for (v, seed) in sorted(by) if v == a
            and by.get((a, seed)) is not None and by.get((b, seed)) is not None}


def comparisons(study: dict, arms: list[str]) -> list[tuple[str, str]]:
    """The pre-registered pairs (a, b), read a - b: vapo minus each baseline, each mechanism arm
    minus vapo and minus the no-critic arm; or the study's own "pairs"."""
    if "pairs" in study:
        return [(a, b) for a, b in study["pairs"] if a in arms and b in arms]
    base, rest = study["primary"][0], study["primary"][1:]
    out = ([(base, b) for b in rest] + [(m, base) for m in study["mechanism"]]
           + [(m, rest[0]) for m in study["mechanism"]])
    return [(a, b) for a, b in out if a in arms and b in arms]


def reading(summaries: list[dict], a: str, b: str, key: str) -> tuple[str, tuple[float, float, float] | None]:
    """("above 0" | "below 0" | "unresolved" | "-", (mean, low, high)) of the paired a - b."""
    ci = t_interval(list(paired(summaries, a, b, key).values()))
    if ci is None:
        return "-", None
    return ("unresolved" if ci[1] <= 0 <= ci[2] else "above 0" if ci[1] > 0 else "below 0"), ci


def decisions(summaries: list[dict], study: dict) -> str:
    """The critic study's decision rules (docs/benchmarks.md, "What does the critic buy?"), applied
    mechanically to the primary endpoint, so that the reading is the rules' and not the analyst's.
    Rule 5 is read per resolved mechanism comparison: it counts as a finding only if the paired mean
    of the long-chain avg@K moves the same way (its interval is printed beside it)."""
    done = [s for s in summaries if s["status"] == "finished"]
    key, long = ENDPOINTS[0][0], "long_avg@K"
    base, free = study["primary"][0], study["primary"][1]
    fmt = lambda ci: f"{ci[0]:+.3f} [{ci[1]:+.3f}, {ci[2]:+.3f}]"  # noqa: E731
    r1, g = reading(done, base, free, key)
    if g is None:
        return "Decision rules: not applicable (no paired runs of the primary arms).\n"
    out = ["Decision rules (pre-registered), applied to the primary endpoint:", ""]
    verdict = {"above 0": "helps", "below 0": "hurts", "unresolved": "is unresolved at this scale"}[r1]
    out.append(f"1. `{base} - {free}` = {fmt(g)}: the critic {verdict}"
               + (f" (the interval rules out effects outside [{g[1]:+.3f}, {g[2]:+.3f}])." if r1 == "unresolved"
                  else "."))
    mech = {m: (reading(done, m, base, key), reading(done, m, free, key)) for m in study["mechanism"]}
    if r1 == "unresolved":
        out.append("2. Rule 1 does not resolve: no arm explains anything; "
                   f"the mechanism arms are read as `M - {base}` alone.")
    else:
        opposite = "below 0" if r1 == "above 0" else "above 0"
        parts = []
        for m, ((rv, _), (rn, _)) in mech.items():
            if rv == "-":  # no paired runs: nothing to read
                continue
            what = ("explains the gap" if rv == opposite and rn == "unresolved" else
                    "partly explains the gap" if rv == opposite and rn == r1 else "does not explain the gap")
            parts.append(f"`{m}` {what} (`{m} - {base}` {rv}, `{m} - {free}` {rn})")
        out.append("2. " + "; ".join(parts) + ".")
    for rule, arms, what in ((3, ["vapo_critic_4x"], "critic capacity"),
                             (4, ["vapo_vp0", "vapo_vp50"], "value-pretraining length")):
        arms = [m for m in arms if m in mech and mech[m][0][1] is not None]
        resolved = [f"`{m} - {base}` {mech[m][0][0]}" for m in arms if mech[m][0][0] != "unresolved"]
        if not arms:
            out.append(f"{rule}. {what.capitalize()}: no paired runs.")
            continue
        out.append(f"{rule}. {what.capitalize()} "
                   + (f"matters: {', '.join(resolved)}." if resolved else "does not resolve: "
                      + ", ".join(f"`{m} - {base}` = {fmt(mech[m][0][1])}" for m in arms) + "."))
    lines = []
    for m, pair in mech.items():  # with rule 1 unresolved, only M - base is read (rule 2)
        for (r, ci), b in zip(pair if r1 != "unresolved" else pair[:1], (base, free)):
            if r in ("above 0", "below 0"):
                lr, lci = reading(done, m, b, long)
                same = lci is not None and (lci[0] > 0) == (r == "above 0") and lci[0] != 0
                lines.append(f"`{m} - {b}` {r}: long-chain avg@K {fmt(lci) if lci else '-'} "
                             + ("moves the same way: a finding" if same
                                else "does not move the same way: reported, not a finding"))
    out.append("5. " + ("; ".join(lines) + "." if lines else "No mechanism comparison resolves."))
    return "\n".join(out) + "\n"


def holm_readings(done: list[dict], study: dict, key: str) -> dict[tuple[str, str], tuple]:
    """{(a, b): (reading, (mean, low, high, p), Holm-adjusted p)} of the study's primary pairs on `key`:
    a pair resolves (above or below 0, by its mean's sign) when its Holm-adjusted p is below 0.05."""
    tests = {pair: t_test(list(paired(done, *pair, key).values())) for pair in study["pairs"]}
    adjusted = holm({pair: r[3] for pair, r in tests.items() if r is not None})
    out = {}
    for pair, r in tests.items():
        if r is None:
            out[pair] = ("-", None, None)
        else:
            out[pair] = ("unresolved" if adjusted[pair] >= 0.05 else "above 0" if r[0] > 0 else "below 0", r,
                         adjusted[pair])
    return out


def holm_tables(done: list[dict], study: dict, arms: list[str]) -> list[str]:
    """The primary pairs under Holm's correction, per endpoint; the secondary pairs, uncorrected (they describe)."""
    lines = []
    for key, title in ENDPOINTS:
        lines += [f"Primary comparisons, {title}: paired t-test per pair (95% interval unadjusted), Holm's correction "
                  "over the pairs decides the reading:", "",
                  "| a - b | n | mean | 95% interval | p | Holm p | reading | per seed |",
                  "|---|---|---|---|---|---|---|---|"]
        for (a, b), (said, r, adj) in holm_readings(done, study, key).items():
            d = paired(done, a, b, key)
            cells = ["-"] * 4 if r is None else [f"{r[0]:+.3f}", f"[{r[1]:+.3f}, {r[2]:+.3f}]", f"{r[3]:.4f}",
                                                 f"{adj:.4f}"]
            per = ", ".join(f"{k}: {v:+.3f}" for k, v in d.items())
            lines.append(f"| {a} - {b} | {len(d)} | " + " | ".join(cells) + f" | {said} | {per} |")
        lines.append("")
    pairs = [(a, b) for a, b in study.get("secondary_pairs", []) if a in arms and b in arms]
    if pairs:
        lines += ["Secondary comparisons (described, not decided; uncorrected 95% t-intervals):", "",
                  "| a - b | endpoint | n | mean | 95% interval |", "|---|---|---|---|---|"]
        for a, b in pairs:
            for key, _ in ENDPOINTS:
                r = t_test(list(paired(done, a, b, key).values()))
                cells = ["-", "-"] if r is None else [f"{r[0]:+.3f}", f"[{r[1]:+.3f}, {r[2]:+.3f}]"]
                lines.append(f"| {a} - {b} | {key} | {len(paired(done, a, b, key))} | {cells[0]} | {cells[1]} |")
        lines.append("")
    return lines


def oracle_decisions(done: list[dict], study: dict) -> str:
    """The positive control's decision rules (docs/benchmarks.md, "Can any critic help?"), applied to the
    primary endpoint under Holm's correction, mechanically."""
    key = ENDPOINTS[0][0]
    learned, oracle, free = study["share"]
    readings = holm_readings(done, study, key)
    said, r, adj = readings[(oracle, free)]
    if r is None:
        return "Decision rules: not applicable (no paired runs of the oracle and the value-free arm).\n"
    fmt = lambda x: f"{x[0]:+.3f} [{x[1]:+.3f}, {x[2]:+.3f}], Holm p {adj:.4f}"  # noqa: E731
    out = ["Decision rules (pre-registered), applied to the primary endpoint:", ""]
    if said == "above 0":
        gain, captured = paired(done, oracle, free, key), paired(done, learned, free, key)
        seeds = sorted(set(gain) & set(captured))
        ratio, low, high = fieller([captured[s] for s in seeds], [gain[s] for s in seeds])
        bounds = f"[{low:+.2f}, {high:+.2f}]" if low is not None else "unbounded"
        out.append(f"1. `{oracle} - {free}` = {fmt(r)}: resolved above 0. A value function can help on this task.")
        out.append(f"2. The learned critic captures {ratio:+.2f} of the oracle's gain, 95% Fieller interval {bounds} "
                   f"(`{learned} - {free}` over `{oracle} - {free}`, {len(seeds)} warm starts).")
    elif said == "below 0":
        out.append(f"1. `{oracle} - {free}` = {fmt(r)}: resolved BELOW 0. An oracle that hurts is looked at as a "
                   "defect first (docs/benchmarks.md); no share is computed.")
    else:
        out.append(f"1. `{oracle} - {free}` = {fmt(r)}: unresolved. This task cannot show a critic's value at this "
                   "scale; the variant that could is designed, not run (docs/benchmarks.md).")
    rest = [f"`{a} - {b}` {readings[(a, b)][0]}" for a, b in study["pairs"] if (a, b) != (oracle, free)]
    out.append("3. The other primary comparisons, under Holm's correction: " + "; ".join(rest) + ".")
    return "\n".join(out) + "\n"


def single_decisions(done: list[dict], study: dict) -> str:
    """The one-answer-per-prompt study's decision rules (docs/benchmarks.md, "Where should a critic
    pay?"), applied to the primary endpoint under Holm's correction, mechanically. study["pairs"]
    is, in order: the learned critic at n=1 against the value-free batch baseline at n=1; against
    GRPO at equal answers per step; against VAPO at the group size."""
    key = ENDPOINTS[0][0]
    readings = holm_readings(done, study, key)
    (critic, free), (_, grpo), (_, group) = study["pairs"][:3]
    said, r, adj = readings[(critic, free)]
    if r is None:
        return "Decision rules: not applicable (no paired runs of the critic and the batch baseline at n=1).\n"

    def fmt(pair):
        w, x, p = readings[pair]
        return f"{x[0]:+.3f} [{x[1]:+.3f}, {x[2]:+.3f}], Holm p {p:.4f}: {w}" if x else "no paired runs"

    out = ["Decision rules (pre-registered), applied to the primary endpoint:", ""]
    if said == "below 0":
        out.append(f"1. `{critic} - {free}` = {fmt((critic, free))}. A learned critic that loses to the batch-mean "
                   "baseline at one answer per prompt is a defect to find: the critic's targets, value pretraining, "
                   "learning rate and placement are reviewed before any other comparison is read.")
        out.append("2. The other comparisons are not read until that review is written (docs/benchmarks.md).")
        return "\n".join(out) + "\n"
    if said == "above 0":
        out.append(f"1. `{critic} - {free}` = {fmt((critic, free))}. The learned critic pays at one answer per "
                   "prompt on this task: it beats the best value-free baseline that exists there.")
    else:
        out.append(f"1. `{critic} - {free}` = {fmt((critic, free))}. The critic is not shown to pay at one answer "
                   f"per prompt; the interval bounds what it can be ({r[1]:+.3f} to {r[2]:+.3f}).")
    w = readings[(critic, grpo)][0]
    out.append(f"2. `{critic} - {grpo}` (equal answers per step) = {fmt((critic, grpo))}. " + {
        "above 0": "One answer per prompt with a critic beats GRPO's groups at the same generation.",
        "below 0": "GRPO's group baseline beats the critic at one answer per prompt at the same generation.",
        "unresolved": "Neither is shown to beat the other at the same generation."}.get(w, ""))
    w = readings[(critic, group)][0]
    out.append(f"3. `{critic} - {group}` = {fmt((critic, group))}. " + {
        "above 0": "VAPO does better with one answer per prompt than with its groups "
                   "(component 7 not shown to pay here).",
        "below 0": "VAPO's group sampling (component 7) pays against one answer per prompt, at equal answers.",
        "unresolved": "Group sampling is not shown to matter to VAPO at equal answers."}.get(w, ""))
    return "\n".join(out) + "\n"


def study_report(summaries: list[dict], study: dict, arms: list[str]) -> str:
    done = [s for s in summaries if s["status"] == "finished"]
    lines = ["Per arm: mean ± std [min, max] over the seeds listed; `samples` trained, `samples_generated` "
             "including value pretraining and dynamic sampling's extra rounds.", "", table(summaries, STUDY_COLUMNS)]
    missing = [f"{s['variant']} seed {s['seed']}" for s in summaries if s["status"] != "finished"]
    if missing:
        lines += [f"Not finished: {', '.join(missing)}.", ""]
    for key, title in ENDPOINTS if not study.get("holm") else ():  # with Holm: holm_tables below
        lines += [f"Paired differences, {title} (each seed's a - b; 95% t-interval):", "",
                  "| a - b | n | mean | 95% interval | reading | per seed |", "|---|---|---|---|---|---|"]
        for a, b in comparisons(study, arms):
            d = paired(done, a, b, key)
            said, ci = reading(done, a, b, key)
            per = ", ".join(f"{k}: {v:+.3f}" for k, v in d.items())
            cells = ["-", "-"] if ci is None else [f"{ci[0]:+.3f}", f"[{ci[1]:+.3f}, {ci[2]:+.3f}]"]
            lines.append(f"| {a} - {b} | {len(d)} | {cells[0]} | {cells[1]} | {said} | {per} |")
        lines.append("")
    if study.get("holm"):  # several primary comparisons: Holm's correction decides their readings
        lines += holm_tables(done, study, arms)
    if study.get("rules") == "critic":  # the critic study's pre-registered decision rules
        lines += [decisions(summaries, study)]
    elif study.get("rules") == "oracle":
        lines += [oracle_decisions(done, study)]
    elif study.get("rules") == "single":
        lines += [single_decisions(done, study)]
    lines += ["Critic: explained variance of the return by response position (mean over seeds), and how often a "
              "wrong answer's most negative TD error is within 2 tokens of its first wrong token (all seeds):", "",
              "| arm | EV by position | within 2 of the first error |", "|---|---|---|"]
    for v in arms:
        credits = [s["credit"] for s in done if s["variant"] == v and s.get("credit")]
        if not credits:
            continue
        ev: dict[str, list[float]] = {}
        for c in credits:
            for pos, e in c["explained_variance_by_position"].items():
                if e["explained_variance"] is not None:
                    ev.setdefault(pos, []).append(e["explained_variance"])
        near = sum(c["most_negative_td_vs_first_error"]["within_2"] for c in credits)
        wrong = sum(c["wrong_with_a_first_error"] for c in credits)
        by_pos = ", ".join(f"{p}: {statistics.fmean(x):.2f}"
                           for p, x in sorted(ev.items(), key=lambda i: int(i[0].split("-")[0])))
        lines.append(f"| {v} | {by_pos} | {near} of {wrong} |")
    return "\n".join(lines) + "\n"


def seed_figure(summaries: list[dict], path: Path, arms: list[str]) -> None:
    """One panel per arm, one line per seed (the same colour for a seed in every panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({s["seed"] for s in summaries})
    cols = 3
    rows = -(-len(arms) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), sharex=True, sharey=True, squeeze=False)
    for ax, v in zip(axes.flat, arms):
        for s in summaries:
            if s["variant"] == v and s["status"] == "finished":
                vp = s.get("value_pretrain_steps", 0)
                xy = sorted({max(0, it - vp): acc for it, acc in s["curve"]}.items())
                ax.plot([x for x, _ in xy], [y for _, y in xy], color=f"C{seeds.index(s['seed'])}",
                        label=f"seed {s['seed']}")
        ax.set_title(v, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(arms):]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=7)
    fig.supxlabel("RL step (after value pretraining)")
    fig.supylabel("held-out greedy accuracy (100 prompts)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
