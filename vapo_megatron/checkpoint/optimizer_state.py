"""The distributed optimizer's state in a checkpoint: each rank writes and reads only its own share.

    sharded_state(optimizer, model_sd)   what a save writes / a load requests: megatron's plain
                                         state (param groups, step) and this rank's blocks
    load_param_state(optimizer, loaded)  after dist_checkpointing.load filled the blocks: the
                                         param groups and step, through megatron's load_state_dict

megatron-core 0.19.2 offers these formats (distrib_optimizer.py, sharded_state_dict):
  fully_reshardable          every moment in the model's own sharding (optimizer.state.{param,
                             exp_avg,exp_avg_sq}.<the model tensor's key>), so it loads at any
                             TP/PP/DP; but get_parameter_state_dp_zero all-gathers the whole DP
                             group's state (a buffer of the rank's whole TP/PP shard per tensor,
                             float32) on every rank at every save, and allocates and reads it on
                             every rank at every load: DP x its own share (issue 55). Its
                             `distrib_optim_fully_reshardable_mem_efficient` flag gathers on DP
                             rank 0 alone at a save (DP x its share there) and changes no load.
  dp_reshardable             each rank's own bucket ranges, no gather; loads at the same TP/PP
                             only (the buckets follow the model's layout)
  fully_sharded_model_space  the model's sharding, each rank its own slice, as ShardedTensors
                             with a `flattened_range`, which 0.19.2's mapping refuses at every
                             save ("ShardedTensor.flattened_range is not supported")
This module writes fully_reshardable's tensors, with their keys and global shapes, but each rank
only the elements it owns, as fully_sharded_model_space meant to. A rank owns one contiguous range
of each flattened parameter it holds a part of (the distributed optimizer's `param_range`); that
range of a C-contiguous tensor is a union of at most 2 x ndim - 1 rectangular blocks (blocks()),
each one ShardedTensor without a regular grid (megatron leaves their validation to torch DCP, as
for dp_reshardable's buckets), whose data is a view of the optimizer's own tensor: a save copies
nothing beyond what the writer stages (the D2H copy of what the rank writes, megatron's
filesystem_async preload_tensors), a load reads the rank's own blocks into its state in place.
No collective. The blocks of all DP ranks tile every tensor exactly once, so the checkpoint is a
fully_reshardable one (its `param_state_sharding_type` says so): megatron's own loader reads it,
this one reads megatron's, and any layout reads either (torch DCP reshards rectangles).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

FULLY_RESHARDABLE = "fully_reshardable"
PREFIX = "optimizer.state"  # megatron's, sharded_param_state_fully_reshardable
TARGETS = "param_state_targets"


def blocks(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range [lo, hi) of a C-contiguous tensor of `shape` as rectangular blocks, in order:
    (offset, block shape, flat start) each. A partial leading row (recursively), the whole rows,
    a partial trailing row (recursively): at most 2 x ndim - 1 blocks, each contiguous in memory."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,) * len(shape), (hi - lo,) * len(shape), lo)]
    row = math.prod(shape[1:])
    out = []
    if lo % row:  # a partial first row
        r, end = lo // row, min(hi, (lo // row + 1) * row)
        out += [((r, *o), (1, *s), r * row + f) for o, s, f in blocks(lo - r * row, end - r * row, shape[1:])]
        lo = end
    whole_end = hi // row * row
    if lo < whole_end:
        out.append(((lo // row,) + (0,) * (len(shape) - 1), ((whole_end - lo) // row, *shape[1:]), lo))
        lo = whole_end
    if lo < hi:  # a partial last row
        r = lo // row
        out += [((r, *o), (1, *s), r * row + f) for o, s, f in blocks(0, hi - lo, shape[1:])]
    return out


def _model_tensor_parts(sh_base, key: str) -> list[tuple[object, int]]:
    """The model tensor's checkpoint parts under `key`, each (ShardedTensor without data, its first
    element in the flattened local parameter). A ShardedTensorFactory (megatron's SwiGLU linear_fc1
    holds gate and up rows that go to two places of the global tensor, mlp.py
    apply_swiglu_sharded_factory) is built on a meta tensor of the parameter's shape: its parts
    are views, whose storage offsets say which local elements each covers."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(sh_base, ShardedTensor):
        return [(replace(sh_base, key=key, data=None), 0)]
    assert isinstance(sh_base, ShardedTensorFactory), type(sh_base)
    meta = torch.empty(sh_base.data.shape, dtype=torch.float32, device="meta")
    out = []
    for part in nested_values(replace(sh_base, key=key, data=meta).build()):
        if not part.data.is_contiguous():
            raise NotImplementedError(f"{sh_base.key}: a factory part that is not contiguous in the parameter")
        out.append((part.without_data(), part.data.storage_offset()))
    return out


def _state_tensors(opt, model_param) -> dict[str, torch.Tensor]:
    """This rank's owned range of a parameter: "param" (the float32 main copy) and each Adam moment,
    1-D, the optimizer's own tensors (megatron's _get_main_param_and_optimizer_states; torch Adam's
    per-parameter step is left out, the count is in the param groups)."""
    return {k: v for k, v in opt._get_main_param_and_optimizer_states(model_param).items() if k != "step"}


def _param_blocks(opt, model_param, sh_base, owned: range) -> dict[str, list]:
    """{state key: [ShardedTensor block, ...]} of one parameter's owned range `owned` (flat indices)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for state_key, data in _state_tensors(opt, model_param).items():
        pieces = []
        for part, first in _model_tensor_parts(sh_base, f"{PREFIX}.{state_key}.{sh_base.key}"):
            p = part.prepend_axis_num
            lo, hi = max(owned.start, first), min(owned.stop, first + math.prod(part.local_shape))
            if len(part.replica_id) != 3:
                raise ValueError(f"{sh_base.key}: replica_id {part.replica_id} is not megatron's (PP, TP, DP)")
            for offset, shape, flat in blocks(lo - first, hi - first, part.local_shape):
                start = first + flat - owned.start  # in the owned 1-D range
                # The prepended axes (megatron's layer and expert axes) as axes of size 1 of the
                # block itself: 0.19.2 describes an irregular block's stored chunk by its local
                # shape without them (checkpointable.py), which torch DCP then refuses.
                view = data[start:start + math.prod(shape)].view((1,) * p + shape)
                pieces.append(ShardedTensor(
                    part.key, view, view.dtype, tuple(view.shape), part.global_shape,
                    part.global_offset[:p] + tuple(g + o for g, o in zip(part.global_offset[p:], offset)),
                    None, (*part.replica_id[:2], opt.distributed_optimizer_instance_id), 0,
                    allow_shape_mismatch=part.allow_shape_mismatch))
        out[state_key] = pieces
    return out


def _own_blocks(opt, model_sd: dict) -> dict:
    """{index: {state key: [blocks]}} over the parameters this rank owns a part of."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        raise NotImplementedError("the precision-aware optimizer keeps scaled state: no views to write from")
    tensors, _ = extract_sharded_tensors_and_factories(model_sd)
    by_param = {sh.data: sh for sh in nested_values(tensors)}  # megatron's own matching, by tensor identity
    out, index = {}, 0
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for gbuf_range_map in per_bucket:
                for model_param, ranges in gbuf_range_map["param_map"].items():
                    if model_param not in by_param:
                        raise ValueError(f"a parameter of shape {list(model_param.shape)} is not in the model's "
                                         "sharded state dict")
                    owned = range(ranges["param"].start, ranges["param"].end)
                    out[index] = _param_blocks(opt, model_param, by_param[model_param], owned)
                    index += 1
    return out


def _one(opt, model_sd: dict) -> dict:
    """One DistributedOptimizer: megatron's plain state dict (saved once, by rank 0: param groups
    with the step count) and this rank's blocks; `TARGETS`, never saved, keeps the blocks' views
    for the load (load_param_state)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    state = opt.state_dict()
    state["param_state"] = _own_blocks(opt, model_sd)
    state["param_state_sharding_type"] = FULLY_RESHARDABLE
    state[TARGETS] = LocalNonpersistentObject(
        {i: {k: [b.data for b in blocks] for k, blocks in per_key.items()}
         for i, per_key in state["param_state"].items()})
    return state


def sharded_state(optimizer, model_sd: dict) -> dict:
    """The sharded optimizer state a save writes and a load requests (loading into the optimizer's
    own tensors: its state must exist, model_state._init_unstepped_state). A ChainedOptimizer of
    several (a mixture-of-experts model: dense and expert parameters) is laid out as megatron's
    ChainedOptimizer.sharded_state_dict lays it out: {index: state}, keys prefixed `chained_{index}.`."""
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(opts) == 1:
        return _one(opts[0], model_sd)
    optimizer._synchronize_steps()
    out = {}
    for i, opt in enumerate(opts):
        out[i] = _one(opt, model_sd)
        add_prefix_for_sharding(out[i], f"chained_{i}.")
    return out


def load_param_state(optimizer, loaded: dict) -> None:
    """The loaded optimizer state (sharded_state's structure) into `optimizer`. torch DCP reads each
    block into its view of the optimizer's tensor, in place; a block it handed back elsewhere is
    copied there. Then megatron's load_state_dict sets the param groups and the step, without the
    parameter state (it is in place). TE's FusedAdam sets every moment anew in its load_state_dict
    (a copy: twice the moments for a moment), as it does whatever the format."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = [loaded] if len(opts) == 1 else [loaded[i] for i in sorted(loaded)]
    with torch.no_grad():
        for part in parts:
            blocks, targets = part.pop("param_state"), part.pop(TARGETS)
            part.pop("param_state_sharding_type")
            for i, per_key in targets.items():
                for key, views in per_key.items():
                    for view, block in zip(views, blocks[i][key], strict=True):
                        if block.data_ptr() != view.data_ptr():
                            view.copy_(block.view_as(view))
    optimizer.load_state_dict(loaded)


__all__ = ["FULLY_RESHARDABLE", "blocks", "load_param_state", "sharded_state"]
