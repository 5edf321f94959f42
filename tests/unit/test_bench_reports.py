"""The learning studies' reports are rebuilt byte for byte from the committed summaries (issue 56):
`python -m benchmarks.learning --study NAME --report` writes docs/benchmarks/NAME/report.md from
docs/benchmarks/NAME/*.json alone, and any change to the harness, its study definitions
(benchmarks/learning/studies.yaml) or its statistics that changes one character fails here.

The oracle study (issue 54) has no report until its runs finish (docs/benchmarks.md: nothing is
analysed before), so its tables and decision rules are checked on the critic study's committed
summaries, the oracle study's design applied with four of its arms named as critic-study arms that
have runs; the expected text is what the harness wrote before it moved from scripts/ (its output at
32109cc: tests/unit/data/oracle_rules_on_critic_runs.md). Once the oracle study's
report.md is committed, the first test covers it too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.learning.cli as bench
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
    assert set(REPORTED) >= {"critic", "partial", "volume"}, REPORTED


def test_the_oracle_studys_tables_and_rules_keep_their_bytes_on_the_critic_studys_summaries():
    named = {"vapo_oracle": "vapo_whiten", "dr_grpo": "grpo_paper", "dapo_paper": "dapo", "vapo_dapo_volume": "vapo_lambda1"}
    arm = lambda v: named.get(v, v)  # noqa: E731
    study = {k: [arm(v) for v in x] if k in ("primary", "mechanism") else [(arm(a), arm(b)) for a, b in x]
             if k in ("pairs", "secondary_pairs") else tuple(map(arm, x)) if k == "share" else x
             for k, x in STUDIES["oracle"].items()}
    runs = ROOT / STUDIES["critic"]["summaries"]
    rows = [json.loads((runs / f"{v}_seed{s}.json").read_text()) if (runs / f"{v}_seed{s}.json").exists()
            else {"variant": v, "seed": s, "status": "missing"} for v, s in bench.order(study, study["primary"], study["seeds"])]
    want = (ROOT / "tests" / "unit" / "data" / "oracle_rules_on_critic_runs.md").read_text()
    assert bench.report_text(rows, study["primary"], study) == want
