"""The learning studies' reports are rebuilt byte for byte from the committed summaries (issue 56):
`python -m benchmarks.learning --study NAME --report` writes docs/benchmarks/NAME/report.md from
docs/benchmarks/NAME/*.json alone, and any change to the harness, its study definitions
(benchmarks/learning/studies.yaml) or its statistics that changes one character fails here.

The oracle study (issue 54) has no report until its runs finish (docs/benchmarks.md: nothing is
analysed before), so its tables and decision rules are checked on the critic study's committed
summaries, the oracle study's design applied with four of its arms named as critic-study arms that
have runs; the expected text is what the harness wrote before it moved from scripts/ (its output at
32109cc: tests/unit/data/oracle_rules_on_critic_runs.md). Once the oracle study's
report.md is committed, the first test covers it too.

The chain task's tables in docs/benchmarks.md (issue 63) come from summaries of issue 31's harness,
which recorded no settings: `--report --unrecorded` rebuilds them, byte for byte, and a summary
without a record is refused otherwise, in a line naming the flag that was given. The committed
figures (every study's curves.png, docs/benchmarks/chain_learning.png) redraw byte for byte with
the pinned matplotlib. And the condensed tables docs/benchmarks.md shows of each study carry only
numbers of that study's rebuilt report.md, row by row."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest

import benchmarks.learning.cli as bench
from benchmarks.learning.report import figure, seed_figure
from benchmarks.learning.variants import STUDIES

ROOT = Path(__file__).resolve().parents[2]
REPORTED = [name for name, s in STUDIES.items() if (ROOT / s["summaries"] / "report.md").exists()]


@pytest.mark.parametrize("name", REPORTED)
def test_a_studys_report_rebuilds_byte_identical_from_its_committed_summaries(name):
    a, variants, study = bench.parse(["--study", name, "--report"])
    b = bench.Bench(a)
    summaries = bench.read_summaries(b, bench.order(study, variants, a.seeds))  # each record checked, too
    assert bench.report_text(summaries, variants, study) == (ROOT / study["summaries"] / "report.md").read_text()


def test_the_committed_reports_are_all_found():  # an empty parametrization above would pass silently
    assert set(REPORTED) >= {"critic", "partial", "volume", "single"}, REPORTED


def test_the_oracle_studys_tables_and_rules_keep_their_bytes_on_the_critic_studys_summaries():
    named = {"vapo_oracle": "vapo_whiten", "dr_grpo": "grpo_paper", "dapo_paper": "dapo",
             "vapo_dapo_volume": "vapo_lambda1"}
    arm = lambda v: named.get(v, v)  # noqa: E731
    study = {k: [arm(v) for v in x] if k in ("primary", "mechanism") else [(arm(a), arm(b)) for a, b in x]
             if k in ("pairs", "secondary_pairs") else tuple(map(arm, x)) if k == "share" else x
             for k, x in STUDIES["oracle"].items()}
    runs = ROOT / STUDIES["critic"]["summaries"]
    rows = [json.loads((runs / f"{v}_seed{s}.json").read_text()) if (runs / f"{v}_seed{s}.json").exists()
            else {"variant": v, "seed": s, "status": "missing"}
            for v, s in bench.order(study, study["primary"], study["seeds"])]
    want = (ROOT / "tests" / "unit" / "data" / "oracle_rules_on_critic_runs.md").read_text()
    assert bench.report_text(rows, study["primary"], study) == want


# ---- the chain task's tables and figure: issue 31's summaries, which record no settings -------------------

CHAIN = ROOT / "docs" / "benchmarks" / "chain"
DOCS = ROOT / "docs" / "benchmarks.md"
CHAIN_TABLES = ("vapo,grpo,dapo", "vapo,vanilla_ppo,no_value_pretrain,no_decoupled_gae,no_length_adaptive")
CHAIN_FIGURE = "vapo,grpo,dapo,vanilla_ppo,no_value_pretrain,no_decoupled_gae,no_length_adaptive"


def _chain(variants: str, *more: str):
    a, names, _ = bench.parse(["--report", "--unrecorded", "--summaries", str(CHAIN), "--variants", variants,
                               "--seeds", "0,1,2", "--data-seed", "0", *more])
    b = bench.Bench(a)
    return b, names, bench.read_summaries(b, bench.order(None, names, a.seeds))


@pytest.mark.parametrize("variants", CHAIN_TABLES)
def test_the_chain_tables_in_the_docs_rebuild_byte_identical_from_the_unrecorded_summaries(variants):
    b, names, summaries = _chain(variants)
    assert all(s["status"] == "finished" and s.get("record") is None for s in summaries)  # 3 seeds each, no records
    docs = DOCS.read_text()
    text = bench.report_text(summaries, names, None, b.data_seed)
    assert text in docs, text
    command = (f"python -m benchmarks.learning --report --unrecorded --summaries docs/benchmarks/chain --variants "
               f"{variants} --seeds 0,1,2 --data-seed 0")
    assert command in " ".join(docs.replace("\\\n", " ").split()), command  # the docs name the command


def test_the_committed_figures_redraw_byte_identical(tmp_path):
    _, names, summaries = _chain(CHAIN_FIGURE)
    figure(summaries, tmp_path / "chain.png")
    assert (tmp_path / "chain.png").read_bytes() == (ROOT / "docs" / "benchmarks" / "chain_learning.png").read_bytes()
    for name in REPORTED:
        a, variants, study = bench.parse(["--study", name, "--report"])
        rows = bench.read_summaries(bench.Bench(a), bench.order(study, variants, a.seeds))
        seed_figure(rows, tmp_path / f"{name}.png", variants)
        assert (tmp_path / f"{name}.png").read_bytes() == (ROOT / study["summaries"] / "curves.png").read_bytes(), name


def test_a_summary_without_a_record_is_refused_naming_the_flag_given(tmp_path, capsys):
    def refused(*argv: str) -> str:
        rc = bench.main(["--report", "--variants", "vapo", "--seeds", "0", "--data-seed", "0", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        return err

    err = refused("--summaries", str(CHAIN), "--out", str(tmp_path / "none"))
    assert "vapo_seed0.json has no record of its settings" in err and "use another --summaries or remove it" in err
    assert "--out" not in err and "--unrecorded" in err, err
    run = tmp_path / "out" / "vapo" / "seed0"  # the same summary in a run directory: --out is the flag to change
    run.mkdir(parents=True)
    shutil.copy(CHAIN / "vapo_seed0.json", run / "summary.json")
    err = refused("--out", str(tmp_path / "out"))
    assert f"{run / 'summary.json'} has no record" in err and "use another --out or remove it" in err, err
    assert "--summaries" not in err, err


# ---- docs/benchmarks.md's condensed study tables carry the rebuilt reports' numbers -------------------------

SECTIONS = {"## The critic study's results": "critic", "### At DAPO's generation": "volume",
            "## The positive control's results": "oracle", "#### Results": "partial",
            "## One answer per prompt: the results": "single"}
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def _numbers(text: str) -> list[str]:
    return [n.replace(",", "").lstrip("+") for n in NUMBER.findall(text)]


def test_the_docs_study_tables_hold_only_their_reports_numbers():
    """Each data row of those tables whose first cell is an arm or a pair (as report.md names it) has
    no number that report.md's first row of that arm or pair lacks (the primary endpoint's table:
    the docs show its intervals and per-seed values, fewer digits of nothing). One cell is the docs'
    own and checked here from the summaries: the oracle study's warm-start CPU s, 305 over 9 seeds
    (seed 103's warm start recorded 0 s)."""
    lines, study, checked = DOCS.read_text().splitlines(), None, 0
    for i, line in enumerate(lines):
        if line.startswith("#"):
            study = next((v for k, v in SECTIONS.items() if line.startswith(k)), None)
        if not (study and line.startswith("| ") and i + 1 < len(lines)) or lines[i + 1].startswith("|---"):
            continue  # outside the studies' sections, or a header
        key, cells = line.split("|")[1].strip().strip("`"), line.split("|", 2)[2]
        report = (ROOT / STUDIES[study]["summaries"] / "report.md").read_text().splitlines()
        rows = [r for r in report if r.startswith("| ") and r.split("|")[1].strip() == key]
        if not rows:
            continue  # a table of another source (oracle_review's advantages)
        if study == "oracle" and key == "warm start (before RL)":
            warm = {}
            for p in (ROOT / STUDIES["oracle"]["summaries"]).glob("*_seed*.json"):
                s = json.loads(p.read_text())
                if s.get("warm_start"):
                    warm[s["record"]["warm_start"]["data_seed"]] = s["warm_start"]["cpu_s"]
            timed = [c for c in warm.values() if c]
            assert (len(timed), round(statistics.fmean(timed))) == (9, 305) and warm[103] == 0
            assert "| 305 (9 seeds; 103's time was not recorded) |" in line
            cells = cells.replace("305 (9 seeds; 103's time was not recorded)", "")
        have = set(_numbers(rows[0].split("|", 2)[2]))
        assert [n for n in _numbers(cells) if n not in have] == [], (study, line, rows[0])
        checked += 1
    assert checked >= 47, checked  # every section: 10 + 8 critic, 3 volume, 7 + 5 oracle, 4 + 2 partial, 5 + 3 single
