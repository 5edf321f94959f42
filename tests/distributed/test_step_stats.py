"""algorithms/step_stats.py on two real gloo ranks with uneven rows, handed mcore/dp_stats.py's
reductions, against the same functions on one process over all rows (reductions: the identity):
the step's figures are exactly global over DP ranks whatever each rank holds."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.dist_utils import run_ranks

ROWS = [5, 2]  # rows per rank: uneven on purpose
S = 9


def _rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = sum(ROWS)
    x, values, returns = (torch.randn(n, S, generator=g, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(n, S, generator=g) > 0.35).double()
    mask[-1] = 0  # a row without a response token
    return x, values, returns, mask


def _figures(x, values, returns, mask, reduce, reduce_max):
    from vapo_megatron.algorithms import step_stats

    extremes = reduce_max(torch.tensor([float((x * mask).max()), -float((x * mask).min())], dtype=torch.float64))
    return {"mean": step_stats.global_mean(x, mask, reduce=reduce),
            "whitened": step_stats.whiten_advantages(x, mask, reduce=reduce),
            "ev": step_stats.explained_variance(values, returns, mask, reduce=reduce),
            "extremes": extremes.tolist()}


def _rank():
    from vapo_megatron.mcore import dp_stats, parallel

    parallel.init_distributed(1, 1, seed=0)
    rank = parallel.dp_rank()
    lo = sum(ROWS[:rank])
    rows = slice(lo, lo + ROWS[rank])
    x, values, returns, mask = (t[rows] for t in _rows())
    out = _figures(x, values, returns, mask, dp_stats.dp_sum, dp_stats.dp_max)
    parallel.destroy()
    return out


def test_step_figures_over_uneven_ranks_equal_one_process_over_all_rows():
    ranks = run_ranks(2, _rank, timeout=120)
    ref = _figures(*_rows(), lambda t: t, lambda t: t)
    whitened = torch.cat([r["whitened"] for r in ranks])
    assert torch.allclose(whitened, ref["whitened"], rtol=0, atol=1e-12)
    for r in ranks:
        assert r["mean"] == pytest.approx(ref["mean"], rel=1e-12)
        assert r["ev"] == pytest.approx(ref["ev"], rel=1e-12) and math.isfinite(r["ev"])
        assert r["extremes"] == ref["extremes"]
