"""The reductions a step's figures take over the data-parallel group: the collectives only. The
figures themselves (means, whitening, explained variance, off-policy weights) are pure functions in
algorithms/step_stats.py that are handed these (docs/algorithm.md, the parallel-aware form)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from vapo_megatron.mcore import parallel


def dp_sum(t: torch.Tensor) -> torch.Tensor:
    """t summed in place over the data-parallel group (the reduction the estimators take)."""
    if parallel.dp_size() > 1:
        parallel.all_reduce(t, group=parallel.dp_group())
    return t


def dp_max(t: torch.Tensor) -> torch.Tensor:
    """t's elementwise max, in place, over the data-parallel group."""
    if parallel.dp_size() > 1:
        parallel.all_reduce(t, op=dist.ReduceOp.MAX, group=parallel.dp_group())
    return t


def global_sum(value: float) -> float:
    """A float summed over the data-parallel group."""
    return float(dp_sum(torch.tensor([value], dtype=torch.float64)))


__all__ = ["dp_max", "dp_sum", "global_sum"]
