"""The tensor transforms behind the name table's layouts (table.py): HF <-> Megatron, TP shards.

Layouts ("full" always means the whole, unsharded tensor, in the layout that megatron's own
dist checkpoints store, which does not depend on TP):
  copy     one HF tensor, same shape.
  qkv      HF q_proj, k_proj, v_proj (weight [heads*d, H] or bias [heads*d]) -> Megatron's fused
           linear_qkv, grouped per query group g: [q heads of g (nh/ng of them), k_g, v_g].
           Column-parallel TP sharding along dim 0 then splits whole groups.
  gate_up  HF gate_proj, up_proj [ffn, H] -> linear_fc1 [2*ffn, H] stored as [gate; up].
           A TP rank holds [gate rows of the rank; up rows of the rank] (SwiGLU chunks the
           local output in two), so sharding is not a plain split: see `shard` / `unshard`.
  vocab    embedding / output rows; Megatron pads the vocabulary to a multiple of 128*TP
           (`padded_vocab`); the padding rows are zero on import and stripped on export.
Pure functions of tensors: no process groups here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model_providers.table import Row, head_dim, query_groups


def _heads(hf_cfg: dict) -> tuple[int, int, int]:
    return hf_cfg["num_attention_heads"], query_groups(hf_cfg), head_dim(hf_cfg)


def hf_to_mcore(row: Row, hf_tensors: list[Tensor], hf_cfg: dict, *, padded_vocab: int | None = None) -> Tensor:
    """Full HF tensors (in `row.hf` order) -> the full Megatron tensor for `row.mcore`."""
    if row.layout == "copy":
        return hf_tensors[0]
    if row.layout == "vocab":
        (t,) = hf_tensors
        if padded_vocab is None or padded_vocab == t.shape[0]:
            return t
        if padded_vocab < t.shape[0]:
            raise ValueError(f"{row.hf[0]}: padded vocab {padded_vocab} < HF vocab rows {t.shape[0]}")
        pad = t.new_zeros((padded_vocab - t.shape[0], *t.shape[1:]))
        return torch.cat([t, pad], dim=0)
    if row.layout == "gate_up":
        return torch.cat(hf_tensors, dim=0)
    # qkv: [nh*d, ...], [ng*d, ...], [ng*d, ...] -> [ng, (nh/ng + 2)*d, ...] -> [(nh+2ng)*d, ...]
    nh, ng, d = _heads(hf_cfg)
    q, k, v = hf_tensors
    rest = q.shape[1:]
    q = q.reshape(ng, nh // ng * d, *rest)
    k = k.reshape(ng, d, *rest)
    v = v.reshape(ng, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape((nh + 2 * ng) * d, *rest)


def mcore_to_hf(row: Row, tensor: Tensor, hf_cfg: dict, layer: int | None = None) -> list[tuple[str, Tensor]]:
    """The full Megatron tensor of `row` -> [(HF name, full HF tensor)], padding removed."""
    names = row.hf_names(layer)
    if row.layout == "copy":
        return [(names[0], tensor)]
    if row.layout == "vocab":
        return [(names[0], tensor[: hf_cfg["vocab_size"]])]
    if row.layout == "gate_up":
        gate, up = tensor.chunk(2, dim=0)
        return [(names[0], gate), (names[1], up)]
    nh, ng, d = _heads(hf_cfg)
    rest = tensor.shape[1:]
    grouped = tensor.reshape(ng, (nh // ng + 2) * d, *rest)
    q, k, v = grouped.split([nh // ng * d, d, d], dim=1)
    return [
        (names[0], q.reshape(nh * d, *rest)),
        (names[1], k.reshape(ng * d, *rest)),
        (names[2], v.reshape(ng * d, *rest)),
    ]


def hf_shapes(row: Row, full_shape: tuple[int, ...], hf_cfg: dict) -> list[torch.Size]:
    """Shapes of the HF tensors (in `row.hf` order) that `mcore_to_hf` makes from a full
    Megatron tensor of `full_shape` (vocab padding included)."""
    rest = tuple(full_shape[1:])
    if row.layout == "copy":
        return [torch.Size(full_shape)]
    if row.layout == "vocab":
        return [torch.Size((hf_cfg["vocab_size"], *rest))]
    if row.layout == "gate_up":
        return [torch.Size((full_shape[0] // 2, *rest))] * 2
    nh, ng, d = _heads(hf_cfg)
    return [torch.Size((nh * d, *rest)), torch.Size((ng * d, *rest)), torch.Size((ng * d, *rest))]


def place_shard(row: Row, shard: Tensor, rank: int, tp: int, partition_dim: int | None, outs: list[Tensor | None],
                hf_cfg: dict) -> None:
    """Copy TP rank `rank`'s shard (of `tp`) of `row`'s Megatron tensor straight into its place in
    the full HF tensors `outs` (row.hf order, full HF shapes, contiguous; None entries skipped).

    Doing this for every rank equals mcore_to_hf(row, unshard(row.layout, shards, partition_dim))
    without building the full Megatron tensor or the HF tensors in between: weight sync writes
    shards directly into an engine's parameters or a bucket. tp=1: `shard` is the full tensor.
    copy_ casts, so `outs` may have another dtype than the shard."""
    if tp == 1:
        rank, partition_dim = 0, 0
    elif partition_dim is None:
        raise ValueError(f"{row.mcore}: a TP shard needs its partition dim")
    if row.layout in ("copy", "vocab"):
        out = outs[0]
        if out is None:
            return
        n = shard.shape[partition_dim]
        if row.layout == "vocab":
            rows = out.shape[0]  # vocab_size: Megatron's padding rows are dropped
            if partition_dim == 0:
                lo, hi = rank * n, min(rank * n + n, rows)
                if hi > lo:
                    out[lo:hi].copy_(shard[: hi - lo])
                return
            shard = shard[:rows]
        out.narrow(partition_dim, rank * n, n).copy_(shard)
        return
    if partition_dim != 0:
        raise ValueError(f"{row.mcore}: layout {row.layout!r} is TP-sharded along dim 0, got dim {partition_dim}")
    if row.layout == "gate_up":
        # A rank holds [gate rows of the rank; up rows of the rank] (see `shard`).
        f = shard.shape[0] // 2
        for out, part in zip(outs, (shard[:f], shard[f:])):
            if out is not None:
                out[rank * f : (rank + 1) * f].copy_(part)
        return
    # qkv: the shard holds whole query groups g0..g0+gl, each [q heads of g; k_g; v_g].
    nh, ng, d = _heads(hf_cfg)
    per, gl = nh // ng, ng // tp
    rest = tuple(shard.shape[1:])
    parts = shard.reshape(gl, (per + 2) * d, *rest).split([per * d, d, d], dim=1)
    for out, part, width in zip(outs, parts, (per * d, d, d)):
        if out is not None:
            out.view(ng, width, *rest)[rank * gl : (rank + 1) * gl].copy_(part)


# ---- TP sharding of full Megatron tensors (pure: the caller does the communication) ----------

def shard(layout: str, full: Tensor, partition_dim: int, tp: int, rank: int) -> Tensor:
    """The slice of a full Megatron tensor that TP rank `rank` of `tp` holds."""
    if layout == "gate_up" and partition_dim == 0:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=partition_dim)[rank]


def unshard(layout: str, shards: list[Tensor], partition_dim: int) -> Tensor:
    """Inverse of `shard`: the TP ranks' slices (in rank order) -> the full Megatron tensor."""
    if layout == "gate_up" and partition_dim == 0:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=partition_dim)
