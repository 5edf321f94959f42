"""The tensor-parallel communication of TE's linear layers (module/linear.py `_Linear`,
layernorm_linear.py `_LayerNormLinear`; distributed.py `gather_along_first_dim`,
`reduce_scatter_along_first_dim`, `allreduce`), as autograd functions on plain torch.distributed.

    column parallel, sequence parallel:   forward all-gather along dim 0, backward reduce-scatter
    column parallel, no SP:               forward identity,                backward all-reduce
    row parallel, sequence parallel:      forward reduce-scatter,          backward all-gather
    row parallel, no SP:                  forward all-reduce,              backward identity

A group of one rank (or None) communicates nothing, as in TE."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if x.shape[0] % n:
        raise ValueError(f"dim 0 ({x.shape[0]}) is not divisible by the TP size {n}")
    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total.chunk(n, dim=0)[dist.get_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


class _GatherForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


def column_input(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """What a column-parallel GEMM multiplies: the whole sequence (gathered under SP)."""
    if _size(group) == 1:
        return x
    return _GatherForward.apply(x, group) if sequence_parallel else _AllReduceBackward.apply(x, group)


def row_output(y: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """A row-parallel GEMM's partial sums, reduced (scattered along the sequence under SP)."""
    if _size(group) == 1:
        return y
    return _ReduceScatterForward.apply(y, group) if sequence_parallel else _AllReduceForward.apply(y, group)


__all__ = ["column_input", "row_output"]
