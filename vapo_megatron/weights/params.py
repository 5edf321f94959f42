"""The parameter iterator everything shares: a Megatron model's weights as HF-named tensors.

Shared by HF import (hf_read.py), mcore-to-hf conversion (from_checkpoint.py, hf_write.py), the
trainer's HF export and weight sync into rollout engines (rollout/weight_sync.py). Each parameter of this
rank's chunks is matched to its table row (model_providers/table.py), TP-gathered along its
partition dim (every rank of a TP group takes part and yields the same sequence), converted to
HF tensors and yielded under its GLOBAL layer number. No full state dict is ever built.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch
from torch import Tensor

from model_providers.family import Family
from model_providers.layouts import mcore_to_hf, unshard
from model_providers.table import TE_ALIASES, Row
from vapo_megatron.mcore import parallel
from vapo_megatron.mcore.models import unwrap

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# A routed expert's weight: megatron's SequentialMLP (local spec) or TE's grouped GEMM, numbered
# locally on each expert-parallel rank.
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(.+)|(linear_fc[12])\.weight(\d+))$")


def expert_key(rest: str, *, per_rank: int, ep_rank: int) -> tuple[str, int | None]:
    """(table key suffix, GLOBAL expert number or None) of a layer-local parameter name: expert-
    parallel rank `ep_rank` holds experts ep_rank * per_rank ... under the local numbers 0 ...,
    as local_experts.{k}.linear_fc1.weight (megatron's SequentialMLP) or linear_fc1.weight{k}
    (Transformer Engine's grouped GEMM)."""
    m = _EXPERT.match(rest)
    if not m:
        return rest, None
    local, suffix = ((int(m.group(1)), m.group(2)) if m.group(1) is not None
                     else (int(m.group(4)), m.group(3) + ".weight"))
    return "mlp.experts.local_experts.{expert}." + suffix, ep_rank * per_rank + local


def is_expert(row: Row) -> bool:
    """Whether a (bound) row is a routed expert's weight, held by one expert-parallel rank."""
    return row.expert is not None


def param_rows(chunk, rows: tuple[Row, ...]) -> Iterator[tuple[Tensor, Row, int | None, str]]:
    """(param, row, global layer or None, local name) for every parameter of one model chunk; an
    expert's row comes bound to its GLOBAL expert number (Row.for_expert).

    A parameter with no row raises, so a table that misses a weight cannot go unnoticed."""
    model = unwrap(chunk)
    by_name = {r.mcore: r for r in rows}
    for name, param in model.named_parameters():
        key, layer, expert = name, None, None
        m = _LAYER.match(name)
        if m:
            local, rest = int(m.group(1)), m.group(2)
            per_rank = model.config.num_moe_experts // parallel.ep_size() if model.config.num_moe_experts else 0
            rest, expert = expert_key(TE_ALIASES.get(rest, rest), per_rank=per_rank, ep_rank=parallel.ep_rank())
            layer = model.decoder.layers[local].layer_number - 1  # megatron's layer_number is global, 1-based
            key = "decoder.layers.{layer}." + rest
        if key not in by_name:
            raise KeyError(f"model parameter {name!r} ({key}) has no row in the mapping table")
        row = by_name[key]
        yield param, (row if expert is None else row.for_expert(expert)), layer, name


def gather_tp(param: Tensor, layout: str, data: Tensor | None = None) -> Tensor:
    """The full Megatron tensor of a (possibly) TP-sharded parameter. `data`: this rank's slice
    when it is not the parameter's own (a meta parameter whose values were read from a
    checkpoint); a CPU slice goes through the GPU when the group communicates with NCCL."""
    tensor = param.detach() if data is None else data
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    tp = parallel.tp_size()
    if tp == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    parallel.all_gather(shards, tensor.contiguous(), group=parallel.tp_group())
    return unshard(layout, shards, param.partition_dim)


def exported_params(model_chunks: list, family: Family, hf_cfg: dict, *, critic: bool = False,
                    experts: bool | None = None) -> Iterator[tuple[Tensor, Row, int | None]]:
    """(param, row, global layer or None) for every weight of this pipeline stage that HF keeps
    and this rank holds. experts: None for all, True only routed experts' weights (this rank's
    share of them), False all others."""
    table = family.table(hf_cfg, critic=critic)
    exported = {r.mcore for r in family.export_table(hf_cfg, critic=critic)}
    for chunk in model_chunks:
        for param, row, layer, _ in param_rows(chunk, table):
            if experts is not None and is_expert(row) != experts:
                continue
            if row.mcore in exported or is_expert(row):  # not the tied output layer: HF keeps only embed_tokens
                yield param, row, layer


def expert_tensors(model_chunks: list, family: Family, hf_cfg: dict, *, critic: bool = False
                   ) -> Iterator[tuple[Row, int, Tensor]]:
    """(row bound to a global expert, global layer, full Megatron tensor) for EVERY routed expert
    of this pipeline stage, whichever expert-parallel rank holds it. Collective over the TP and EP
    groups (every rank of a stage iterates, in the same order): each rank's local expert k is
    TP-gathered, then all-gathered over EP, which brings expert r * E/EP + k of each EP rank r.
    One local expert's worth (x EP) is held at a time."""
    ep = parallel.ep_size()
    per_rank = unwrap(model_chunks[0]).config.num_moe_experts // ep if ep > 1 else 1
    for param, row, layer in exported_params(model_chunks, family, hf_cfg, critic=critic, experts=True):
        full = gather_tp(param, row.layout)
        if ep == 1:
            yield row, layer, full
            continue
        parts = [torch.empty_like(full) for _ in range(ep)]
        parallel.all_gather(parts, full.contiguous(), group=parallel.ep_group())
        local = row.expert - parallel.ep_rank() * per_rank
        for r, part in enumerate(parts):
            yield row.for_expert(r * per_rank + local), layer, part


def iter_hf_tensors(model_chunks: list, family: Family, hf_cfg: dict, *,
                    critic: bool = False) -> Iterator[tuple[str, Tensor]]:
    """Yield (HF name, full tensor) for every weight this pipeline stage holds (every expert of
    it too, gathered over EP: see expert_tensors)."""
    for param, row, layer in exported_params(model_chunks, family, hf_cfg, critic=critic, experts=False):
        full = gather_tp(param, row.layout)
        yield from mcore_to_hf(row, full, hf_cfg, layer)
    for row, layer, full in expert_tensors(model_chunks, family, hf_cfg, critic=critic):
        yield from mcore_to_hf(row, full, hf_cfg, layer)
