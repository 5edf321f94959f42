"""Read a megatron dist checkpoint as HF tensors, in groups of bounded size (mcore-to-hf).

The model is built on the meta device, so megatron's `sharded_state_dict()` says which slice of
which checkpoint tensor each parameter of this rank is (at this run's TP/PP, whatever layout the
checkpoint was written at), without holding any weights. The parameters that HF keeps are cut, in
order, into groups of at most `max_bytes` of HF tensors; each group is one megatron load of a
partial state dict (only those slices are read) and comes out as full, HF-named, contiguous
tensors: one safetensors shard. At most one group is held at a time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch import Tensor

from model_providers.family import Family
from model_providers.layouts import hf_shapes, mcore_to_hf
from model_providers.table import Row
from vapo_megatron.mcore import parallel
from vapo_megatron.weights.params import gather_tp, is_expert, param_rows


@dataclasses.dataclass(frozen=True)
class ExportItem:
    chunk_key: str  # "model", or "model0", "model1", ... with virtual pipeline stages
    local_name: str  # the parameter's name in its chunk (and its sharded state dict key)
    param: Tensor  # meta
    row: Row
    layer: int | None
    nbytes: int  # of the HF tensors it becomes


def exported_items(model_chunks: list, family: Family, hf_cfg: dict, *, critic: bool) -> list[ExportItem]:
    """Every parameter of this rank's chunks that HF keeps (not the tied output layer). Runs at
    expert-parallel size 1 (vapo-convert): every expert is then on every rank."""
    if parallel.ep_size() != 1:
        raise RuntimeError("reading a checkpoint as HF tensors needs expert-parallel size 1 (the checkpoint reshards)")
    table = family.table(hf_cfg, critic=critic)
    exported = {r.mcore for r in family.export_table(hf_cfg, critic=critic)}
    tp = parallel.tp_size()
    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
    items = []
    for key, chunk in zip(keys, model_chunks):
        for param, row, layer, name in param_rows(chunk, table):
            if row.mcore not in exported and not is_expert(row):  # experts: bound to their global number
                continue
            full = list(param.shape)
            if getattr(param, "tensor_model_parallel", False):
                full[param.partition_dim] *= tp
            nbytes = sum(math.prod(s) for s in hf_shapes(row, tuple(full), hf_cfg)) * param.element_size()
            items.append(ExportItem(key, name, param, row, layer, nbytes))
    return items


def groups(items: list[ExportItem], max_bytes: int) -> list[list[ExportItem]]:
    """Consecutive items, at most `max_bytes` of HF tensors per group (a larger single item is
    a group of its own)."""
    out: list[list[ExportItem]] = []
    size = 0
    for item in items:
        if not out or (size + item.nbytes > max_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(item)
        size += item.nbytes
    return out


def _as_chunk(sh: ShardedTensor) -> ShardedTensor:
    """The same slice of the same checkpoint tensor, asked for as a plain chunk (offsets and
    sizes, the form megatron uses for tensors without layer axes) rather than as a cell of a
    regular grid with prepended layer axes. megatron turns a grid cell into a torch ShardedTensor
    that must account for the whole grid, placing the cells it does not hold on "another" rank;
    in a single process that is the same rank, so a request for some of the layers is refused.
    The data becomes a view [1, ..., *local] of the same memory."""
    n = sh.prepend_axis_num
    if n == 0 and sh.axis_fragmentations is None:
        return sh
    return dataclasses.replace(sh, data=sh.data.view((1,) * n + tuple(sh.data.shape)),
                               local_shape=(1,) * n + tuple(sh.local_shape), prepend_axis_num=0,
                               axis_fragmentations=None)


def _request(sharded, buffer: Tensor):
    """A load request for one parameter that fills `buffer` (an empty CPU tensor of the
    parameter's local shape) in place. `sharded`: the parameter's (meta) ShardedTensor or
    ShardedTensorFactory (megatron's SwiGLU fc1, saved as gate and up halves)."""
    if isinstance(sharded, ShardedTensor):
        return _as_chunk(dataclasses.replace(sharded, data=buffer))
    build = sharded.build_fn

    def build_fn(*args):
        return dict_list_map_inplace(lambda x: _as_chunk(x) if isinstance(x, ShardedTensor) else x, build(*args))

    # The halves are views of `buffer`, filled in place: the merge has nothing left to do.
    return dataclasses.replace(sharded, data=buffer, build_fn=build_fn, merge_fn=lambda _loaded: buffer)


def iter_checkpoint_hf_groups(ckpt, model_chunks: list, family: Family, hf_cfg: dict, *, critic: bool,
                              max_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield [(HF name, full contiguous tensor)] per group for this rank's pipeline stage.

    Every TP rank of a stage must iterate (the TP gathers are collective); the loads themselves
    are not collective, so stages with different numbers of groups do not wait for each other."""
    from vapo_megatron.checkpoint import dist_io

    sharded = dist_io.model_sharded_state(model_chunks)
    for group in groups(exported_items(model_chunks, family, hf_cfg, critic=critic), max_bytes):
        buffers = [torch.empty(item.param.shape, dtype=item.param.dtype) for item in group]
        request: dict[str, dict] = {}
        for item, buffer in zip(group, buffers):
            request.setdefault(item.chunk_key, {})[item.local_name] = _request(
                sharded[item.chunk_key][item.local_name], buffer)
        dist_io.load(ckpt, request, part=True)  # fills the buffers
        del request
        out = []
        for item in group:
            local = buffers.pop(0)  # drop each slice once converted
            full = gather_tp(item.param, item.row.layout, data=local)
            out.extend((name, t.contiguous()) for name, t in mcore_to_hf(item.row, full, hf_cfg, item.layer))
            del local, full
        yield out


__all__ = ["ExportItem", "exported_items", "groups", "iter_checkpoint_hf_groups"]
