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

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def unwrap(chunk):
    # DDP / Float16Module wrappers keep the model under `.module`.
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def param_rows(chunk, rows: tuple[Row, ...]) -> Iterator[tuple[Tensor, Row, int | None, str]]:
    """(param, row, global layer or None, local name) for every parameter of one model chunk.

    A parameter with no row raises, so a table that misses a weight cannot go unnoticed."""
    model = unwrap(chunk)
    by_name = {r.mcore: r for r in rows}
    for name, param in model.named_parameters():
        key, layer = name, None
        m = _LAYER.match(name)
        if m:
            local, rest = int(m.group(1)), m.group(2)
            rest = TE_ALIASES.get(rest, rest)
            layer = model.decoder.layers[local].layer_number - 1  # megatron's layer_number is global, 1-based
            key = "decoder.layers.{layer}." + rest
        if key not in by_name:
            raise KeyError(f"model parameter {name!r} ({key}) has no row in the mapping table")
        yield param, by_name[key], layer, name


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


def exported_params(model_chunks: list, family: Family, hf_cfg: dict, *, critic: bool = False
                    ) -> Iterator[tuple[Tensor, Row, int | None]]:
    """(param, row, global layer or None) for every weight of this pipeline stage that HF keeps."""
    table = family.table(hf_cfg, critic=critic)
    exported = {r.mcore for r in family.export_table(hf_cfg, critic=critic)}
    for chunk in model_chunks:
        for param, row, layer, _ in param_rows(chunk, table):
            if row.mcore in exported:  # not the tied output layer: HF keeps only embed_tokens
                yield param, row, layer


def iter_hf_tensors(model_chunks: list, family: Family, hf_cfg: dict, *, critic: bool = False) -> Iterator[tuple[str, Tensor]]:
    """Yield (HF name, full tensor) for every weight this pipeline stage holds."""
    for param, row, layer in exported_params(model_chunks, family, hf_cfg, critic=critic):
        full = gather_tp(param, row.layout)
        yield from mcore_to_hf(row, full, hf_cfg, layer)
