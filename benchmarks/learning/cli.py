"""The learning benchmark (issues 31 and 45): rows of VARIANTS x seeds on the chain task, or a
pre-registered study (STUDIES); both are data, in benchmarks/learning/studies.yaml.

    python -m benchmarks.learning --variants vapo,vanilla_ppo --seeds 0,1,2 [--steps N] [--jobs K]
    python -m benchmarks.learning --study critic --out DIR      the critic study, resumable
    python -m benchmarks.learning --study critic --report       its tables and figure from the summaries
    python -m benchmarks.learning --dry-run                     the commands, nothing run
    python -m benchmarks.learning --report --unrecorded --summaries docs/benchmarks/chain --variants vapo,grpo,dapo \
        --seeds 0,1,2 --data-seed 0                             the chain task's tables (issue 31's summaries)

(from the repository's root; `python scripts/bench_learning.py ...` is the same command from anywhere)

Each run: OUT/<variant>/seed<k>, its config the base YAML without the row's unset keys
(bench.yaml), trained by `torchrun -m vapo_megatron.train` with the row's overrides. Seed k has
its own data and random-init model (make_demo_data.py --seed k, OUT/data/seed<k>; --data-seed N
shares one) and, when the config has an SFT, its own warm start (OUT/warm/seed<k>), from whose
HF export every row of the seed starts RL with sft.steps=0. A row with a critic of its own
("critic") gets a bigger random-init model of the seed, given the same warm start
(OUT/warm/seed<k>_critic<size>), as model.critic_hf_path.

Records: every run, warm start and summary records what it was made with (runs.py); the harness
of issue 31 (scripts/bench_learning.py until issue 45) recorded nothing, and its summaries
(docs/benchmarks/chain) are tabled only by --report --unrecorded, in its own columns. Before
any work, a run made with other settings than this command's is refused with one line, exit 2
(never retrained over, nor tabled beside the others); so are bad flags and settings the trainer
would refuse. Resumes: a finished run is never trained again, and one whose summary is already
in --summaries with a matching record is not even needed; a killed run resumes from its last
checkpoint. The harness's children die with it (a kill -9 included).

After training, vapo-eval evaluates the HF export once, on all of data/eval.jsonl (avg@K at the
training temperature, greedy accuracy), and the short/long chains' figures come from the same
samples; with --credit (the study's default), the credit diagnostics (credit.py) run on every run
with a critic. RUN/summary.json is copied to --summaries (small files to commit). The table goes
to OUT/table.md (a study's report, with paired differences and t-intervals, to
SUMMARIES/report.md), the figure to --figure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.learning.harness import Bench
from benchmarks.learning.report import COLUMNS, STUDY_COLUMNS, figure, seed_figure, study_report, table
from benchmarks.learning.variants import (
    ROOT,
    STUDIES,
    VARIANTS,
    BadInput,
    base_settings,
    derived_yaml,
    has_critic,
    resolve,
)

__all__ = ["VARIANTS", "Bench", "base_settings", "derived_yaml", "main", "resolve"]


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        print(f"bench_learning: error: {message}", file=sys.stderr)
        sys.exit(2)


def positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def seed_list(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more seeds >= 0")
    return seeds


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], dict | None]:
    ap = Parser(prog="python -m benchmarks.learning", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "chain_cpu.yaml"), help="the base config")
    ap.add_argument("--study", choices=sorted(STUDIES), default=None, help="a pre-registered design: its seeds, arms, "
                    "order, vapo-eval K, --summaries and the report (docs/benchmarks.md)")
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated, of: {','.join(VARIANTS)} (default vapo; a study: its arms)")
    ap.add_argument("--seeds", type=seed_list, default=None,
                    help="comma-separated seeds (default 0; a study: its seeds)")
    ap.add_argument("--steps", type=int, default=None, help="trainer.total_steps (default: the config's)")
    ap.add_argument("--jobs", type=positive, default=1, help="runs at a time (each is --nproc processes)")
    ap.add_argument("--nproc", type=positive, default=2, help="torchrun processes per run")
    ap.add_argument("--out", default=None, help="runs, data and table (default runs/bench; a study: required, "
                    "outside the repository)")
    ap.add_argument("--data-seed", type=int, default=None,
                    help="one data set, model init and warm start for every seed (default: each seed its own)")
    ap.add_argument("--task", default="chain", help="make_demo_data.py --task (chain: short/long figures)")
    ap.add_argument("--data-args", default="", help="more make_demo_data.py arguments, one string")
    ap.add_argument("--set", action="append", default=[], help="an override for every variant (repeatable)")
    ap.add_argument("--eval-k", type=positive, default=None,
                    help="vapo-eval's K (default: the config's eval.n_samples)")
    ap.add_argument("--credit", action="store_true", help="credit diagnostics of every run with a critic")
    ap.add_argument("--summaries", default=None, help="also copy each run's summary.json here (and reuse them)")
    ap.add_argument("--figure", default=None, help="PNG of held-out accuracy vs step (default OUT/learning.png)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--report", action="store_true", help="only tabulate runs that have a summary")
    ap.add_argument("--unrecorded", action="store_true",
                    help="with --report: also table summaries that record no settings (issue 31's harness, before "
                         "issue 45: docs/benchmarks/chain), in that harness's columns; their settings are not checked")
    a = ap.parse_args(argv)
    if a.unrecorded and not a.report:
        ap.error("--unrecorded: only with --report (a run is never reused or trained beside a summary of "
                 "unknown settings)")
    if a.unrecorded and a.study:
        ap.error("--unrecorded: not with --study (every study's summaries record their settings)")
    study = STUDIES.get(a.study)
    if study:
        if a.data_seed is not None:
            ap.error("--data-seed: a study's unit is the warm start, every seed has its own")
        arms = study["primary"] + study["mechanism"]
        a.seeds, a.variants = a.seeds or study["seeds"], a.variants or ",".join(arms)
        a.eval_k, a.credit = a.eval_k or study["eval_k"], True
        a.summaries = a.summaries or str(ROOT / study["summaries"])
        a.figure = a.figure or str(Path(a.summaries) / "curves.png")
        if a.out is None and not a.report:
            ap.error(f"--study {a.study}: give --out DIR, a directory outside the repository for its runs")
        if a.out and Path(a.out).resolve().is_relative_to(ROOT):
            ap.error(f"--out {a.out}: inside the repository; a study's runs go outside it (its summaries come back)")
        a.out = a.out or a.summaries
        if others := [v for v in a.variants.split(",") if v and v not in arms]:
            ap.error(f"--variants {','.join(others)}: not arms of the {a.study} study ({', '.join(arms)})")
    a.seeds, a.out = a.seeds or [0], a.out or str(ROOT / "runs" / "bench")
    variants = [v for v in (a.variants or "vapo").split(",") if v]
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if a.data_seed is not None and a.data_seed < 0:
        ap.error(f"--data-seed {a.data_seed}: must be >= 0")
    return a, variants, study


def order(study: dict | None, variants: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """(variant, seed) in the order they run: a study's primary arms over all seeds, then its mechanism arms."""
    blocks = [study["primary"], study["mechanism"]] if study else [variants]
    return [(v, s) for block in blocks for s in seeds for v in block if v in variants]


def dry_run(bench: Bench, plan: list[tuple[str, int]]) -> None:
    said = set()

    def say(key, what: str, cmd: list[str]) -> None:
        if key not in said:
            said.add(key)
            print(f"# {what}\n{shlex.join(cmd)}")

    for v, s in plan:
        d = bench.data_seed(s)
        for c in dict.fromkeys([None, VARIANTS[v].get("critic")]):
            tail = f", the {c} critic's model" if c else ""
            say(("data", d, c), f"data of seed {d}{tail}", bench.data_cmd(s, c))
            if bench.warm:
                say(("warm", d, c), f"warm start of seed {d}{tail}", bench.train_cmd(None, s, c))
                if c is None:
                    say(("warm eval", d), f"vapo-eval of seed {d}'s warm start", bench.eval_cmd(bench.warm_dir(s), s))
        unset = resolve(v, bench.base)[1]
        print(f"# {v}, seed {s}: {bench.run_dir(v, s) / 'bench.yaml'} = {bench.config}"
              + (f" without {', '.join(unset)}" if unset else ""))
        print(shlex.join(bench.train_cmd(v, s)))
        print(shlex.join(bench.eval_cmd(bench.run_dir(v, s), s)))
        if bench.a.credit and has_critic(v):
            print(shlex.join(bench.credit_cmd(bench.run_dir(v, s))))


def report_text(summaries: list[dict], variants: list[str], study: dict | None,
                data_seed: Callable[[int], int] | None = None) -> str:
    """The table (a study's report: report.md) of the finished runs among `summaries`.

    Summaries without a record (--unrecorded: issue 31's harness, docs/benchmarks/chain) are tabled
    in that harness's columns (report.COLUMNS). Their warm start's data seed is data_seed(seed), the
    command's --data-seed, which they did not record; and each of its figures is the first any of
    them recorded, in the table's order: that harness wrote the warm start's wall time into the
    first session's summaries and its held-out figures only into later ones (the same warm start,
    docs/benchmarks.md, "Results")."""
    warm: dict[int, dict] = {}  # the starting point of every row: the warm start's own figures, once per data seed
    unrecorded = False
    for s in summaries:
        if s["status"] == "finished" and s.get("warm_start"):
            w = s["warm_start"]
            row = {"variant": "warm start (before RL)", "status": "finished", "samples": 0,
                   "accuracy": w.get("eval_accuracy"), "avg@K": w.get("eval_avg@K"), "wall_s": w.get("wall_s"),
                   "cpu_s": w.get("cpu_s"),
                   **{k: x for k, x in w.items() if k.startswith(("heldout", "short", "long"))}}
            if s.get("record") is None:
                unrecorded, seed = True, data_seed(s["seed"])
                warm[seed] = {"seed": seed, **{k: x for k, x in row.items() if x is not None}} | warm.get(seed, {})
            else:
                seed = s["record"]["warm_start"]["data_seed"]
                warm[seed] = {"seed": seed, **row}
    rows = list(warm.values()) + summaries
    return study_report(rows, study, variants) if study else table(rows, COLUMNS if unrecorded else STUDY_COLUMNS)


def tabulate(bench: Bench, summaries: list[dict], variants: list[str], study: dict | None) -> None:
    """The table (a study's report) and the figure, of the finished runs among `summaries`."""
    text = report_text(summaries, variants, study, bench.data_seed if bench.a.unrecorded else None)
    print(text, end="")
    path = Path(bench.a.summaries) / "report.md" if study else bench.out / "table.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if any(s["status"] == "finished" for s in summaries):
        if study:
            seed_figure(summaries, Path(bench.a.figure), variants)
        else:
            figure(summaries, Path(bench.a.figure) if bench.a.figure else bench.out / "learning.png")


def read_summaries(bench: Bench, plan: list[tuple[str, int]]) -> list[dict]:
    """--report's input: each planned run's summary (the --summaries copy first), or a "missing" row."""
    return [bench.read_summary(v, s) or {"variant": v, "seed": s, "status": "missing"} for v, s in plan]


def output_problems(a: argparse.Namespace, study: dict | None) -> list[str]:
    """What would fail only at the end, after the runs: the figure's library, unwritable outputs."""
    out = [] if importlib.util.find_spec("matplotlib") else ["matplotlib is not installed; the figure needs it"]
    for flag, path in (("--out", a.out), ("--summaries", a.summaries),
                       ("--figure", a.figure and Path(a.figure).parent)):
        p = Path(path).resolve() if path else None
        while p is not None and not p.exists():
            p = p.parent
        if p is not None and not (p.is_dir() and os.access(p, os.W_OK | os.X_OK)):
            out.append(f"{flag} {path}: {p} is not a writable directory")
    return out


def main(argv: list[str] | None = None) -> int:
    a, variants, study = parse(argv)
    try:
        bench = Bench(a)
        plan = order(study, variants, a.seeds)
        if not a.dry_run and (problems := output_problems(a, study)):
            raise BadInput(problems[0])
        if a.report:
            sources = [p for p in (Path(a.summaries) if a.summaries else None, bench.out) if p]
            if not any(p.is_dir() for p in sources):
                raise BadInput(f"--out {bench.out}: no such directory"
                               + (f", nor --summaries {a.summaries}" if a.summaries else "")
                               + ": nothing to report")
            summaries = read_summaries(bench, plan)
            if not any(s["status"] == "finished" for s in summaries):
                raise BadInput("nothing to report: "
                               f"no summary of {', '.join(variants)} in {' or '.join(map(str, sources))}")
            tabulate(bench, summaries, variants, study)
            return 0
        if problems := bench.settings_problems(variants):
            raise BadInput(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        if a.dry_run:
            dry_run(bench, plan)
            return 0
        if stale := bench.stale(plan) or bench.machine_problems(plan):
            raise BadInput(stale[0] + (f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""))
    except BadInput as e:
        print(f"bench_learning: error: {e}", file=sys.stderr)
        return 2
    with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
        futures = {pool.submit(bench.do_run, v, s): (v, s) for v, s in plan}  # a study's order with --jobs 1
        results = {}
        for f in concurrent.futures.as_completed(futures):
            s = results[futures[f]] = f.result()
            print(f"[bench] {s['variant']} seed {s['seed']}: {s['status']}" + (
                f", held-out avg@K {s.get('heldout_avg@K')}, cpu {s.get('cpu_s')} s" if s["status"] == "finished"
                else f" ({s.get('log_tail')})"), flush=True)
    summaries = [results[p] for p in plan]
    tabulate(bench, summaries, variants, study)
    return 0 if all(s["status"] == "finished" for s in summaries) else 1
