"""vapo-plan --search's refusals by rule (sizing/search.py refusal_causes, closest_refused; issue 63):
the same rule with other numbers is one cause, a layout counts once per cause, and the closest name
different obstacles. The expected texts are written out by hand."""

from __future__ import annotations

from types import SimpleNamespace

from vapo_megatron.sizing.search import refusal_causes


def _rows(*problem_lists):
    return [SimpleNamespace(problems=list(p)) for p in problem_lists]


def test_rules_group_across_numbers_and_count_layouts():
    rows = _rows(
        ["parallel.pp=7 does not divide num_hidden_layers=64", "x=512 must be divisible by 7 * 16 = 112"],
        ["parallel.pp=14 does not divide num_hidden_layers=64"],
        ["x=512 must be divisible by 14 * 16 = 224"],
        ["x=512 must be divisible by 28 * 16 = 448"],
        ["parallel.tp=7 does not divide heads=40", "parallel.tp=7 does not divide heads=40"],  # twice: one layout
    )
    got = [(c.layouts, c.text()) for c in refusal_causes(rows)]
    assert got == [
        (3, "x=512 must be divisible by {7,14,28} * 16 = {112,224,448}"),
        (2, "parallel.pp={7,14} does not divide num_hidden_layers=64"),
        (1, "parallel.tp=7 does not divide heads=40"),
    ]


def test_many_values_are_cut_and_decimals_kept():
    rows = _rows(*[[f"needs {n}.5 GiB of 80 GiB"] for n in range(10, 0, -1)])
    (cause,) = refusal_causes(rows)
    assert cause.layouts == 10
    assert cause.text() == "needs {1.5,2.5,3.5,4.5,5.5,6.5,...} GiB of 80 GiB"
    assert cause.text(shown=20) == "needs {1.5,2.5,3.5,4.5,5.5,6.5,7.5,8.5,9.5,10.5} GiB of 80 GiB"
