"""One model's state in a checkpoint: weights and optimizer state as a megatron dist checkpoint, with
the HF files an export needs (the run's checkpoint manager, manager.py, calls these per model).

    save_model_state(model, path)     collective: path/ (dist checkpoint + hf/ + vapo.json)
    load_model_state(model, path)     collective: weights and optimizer state back into `model`
    optimizer_moments(model)          every optimizer state tensor by a stable name (tests, gpu_check)

Adam keeps its step count per parameter (torch's Adam/AdamW) or per param group (TE's and Apex's
FusedAdam, which megatron-core picks on every GPU node); both layouts go through the same code
(_stepped), so a resume restores the moments of either bitwise (issue 43). The distributed
optimizer's state is written in one format whichever Adam runs (optimizer_state.py), and read in
the format the checkpoint records, so a checkpoint of either Adam resumes with the other (issue 55).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

import torch

from vapo_megatron.checkpoint import (
    dist_io,  # also installs safe_unpickle: no checkpoint pickle runs code
    optimizer_state,
)
from vapo_megatron.mcore import parallel
from vapo_megatron.mcore.model import TrainModel
from vapo_megatron.weights.hf_write import write_source_files

T = TypeVar("T")

# megatron's distributed optimizer writes its sharded Adam state in one of several formats
# (distrib_optimizer.py sharded_state_dict). Every save here writes "fully_reshardable"'s tensors,
# each rank only its own share (optimizer_state.py, which says why none of megatron's own writers
# does): a checkpoint resumes at another TP, PP or DP, with any Adam. Checkpoints written before
# issue 55 with torch's Adam (no TE, no Apex: an air-gapped node) hold "dp_reshardable" state,
# megatron's bucket layout, which loads at the saved TP/PP only (resume_layout_problem). Which
# one a checkpoint holds is recorded in it: megatron saves the optimizer's
# `param_state_sharding_type` with its common state (saved_optimizer_format); a load follows the
# checkpoint's format, never the Adam it finds.
FULLY_RESHARDABLE = optimizer_state.FULLY_RESHARDABLE
DP_RESHARDABLE = "dp_reshardable"


def per_parameter_steps(inner) -> bool:
    """torch's Adam/AdamW (a step count per parameter), not TE's or Apex's FusedAdam (per group)."""
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def has_distributed_optimizer(model: TrainModel) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in megatron_optimizers(model.optimizer))


def distributed_optimizer_format(model: TrainModel) -> str | None:
    """The format a save of `model` writes its distributed optimizer's state in; None without one."""
    return FULLY_RESHARDABLE if has_distributed_optimizer(model) else None


def saved_optimizer_format(path: Path) -> str | None:
    """The distributed optimizer's format a model's dist checkpoint at `path` holds, as megatron
    recorded it (`param_state_sharding_type` in its common state, one per chained optimizer); None
    for a checkpoint without distributed-optimizer state. CheckpointError when it cannot be read."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        opt = dist_checkpointing.load_common_state_dict(str(path)).get("optimizer")  # restricted unpickling
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - damaged or refused: named as such
        raise dist_io.CheckpointError(f"{path}: {dist_io.describe_failure(e)}") from e
    parts = [opt] if isinstance(opt, dict) and "param_state_sharding_type" in opt else \
        [v for v in opt.values() if isinstance(v, dict)] if isinstance(opt, dict) else []
    found = {p["param_state_sharding_type"] for p in parts if "param_state_sharding_type" in p}
    if len(found) > 1:
        raise dist_io.CheckpointError(f"{path}: its optimizers record several formats ({sorted(found)})")
    return found.pop() if found else None


def resume_layout_problem(saved_format: str | None, saved: dict, now: dict) -> str | None:
    """One line when optimizer state of `saved_format` (saved_optimizer_format) cannot load at the
    new layout (state.json's parallel section `saved`, the run's `now`), else None."""
    if saved_format != DP_RESHARDABLE:
        return None
    moved = [f"parallel.{k}={saved.get(k, 1)} -> {now.get(k, 1)}" for k in ("tp", "pp", "vpp")
             if saved.get(k, 1) != now.get(k, 1)]
    if not moved:
        return None
    return (f"{', '.join(moved)}: its distributed optimizer's state is in megatron's dp_reshardable format (an older "
            "checkpoint of torch's Adam), which loads at the saved TP/PP/VPP only; resume at the saved layout (the "
            "checkpoints the run writes from then on load at any layout)")


def megatron_optimizers(optimizer) -> list:
    """The per-param-group megatron optimizers (a ChainedOptimizer holds several)."""
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if o.optimizer is not None]


def _stepped(group: dict, param_state: dict) -> bool:
    """Whether a parameter's optimizer state comes from real steps. Two layouts keep the count:
    torch's Adam/AdamW per parameter (`state["step"]`, a tensor), TE's and Apex's FusedAdam per
    param group (`group["step"]`, an int; transformer_engine/pytorch/optimizers/fused_adam.py and
    apex/optimizers/fused_adam.py `step`). megatron picks the fused ones whenever TE or Apex imports,
    i.e. on every GPU node (megatron/core/optimizer/__init__.py). A count of 0 is the state a save
    before the first step writes (_init_unstepped_state)."""
    return float(param_state.get("step", 0)) > 0 or float(group.get("step", 0) or 0) > 0


def _drop_unstepped_state(model: TrainModel) -> None:
    """Zero moments of an optimizer that has not stepped (saved or loaded before its first step)
    are dropped, so that Adam's next step initializes them as a fresh optimizer would. Moments of
    real steps are never touched, whichever layout keeps the step count (_stepped)."""
    for opt in megatron_optimizers(model.optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if p in inner.state and not _stepped(group, inner.state[p]):
                    inner.state[p].clear()


def _init_unstepped_state(opt) -> None:
    """Zero moments for the parameters that have no optimizer state yet, so that a save before the
    first step holds every key a load asks for (megatron's init_state_fn; it creates them when
    loading). torch's Adam keeps a step count per parameter and megatron's distributed optimizer
    reads it from every state when neither TE nor Apex imports (distrib_optimizer.py state_dict),
    so a never-stepped torch Adam gets the count a fresh one starts from, 0: its next step is then
    exactly a fresh optimizer's first. TE's and Apex's FusedAdam count per group and need none."""
    if opt.init_state_fn is None:
        return
    inner = opt.optimizer
    opt.init_state_fn(inner, opt.config)
    per_param = per_parameter_steps(inner)
    states = [inner.state[p] for g in inner.param_groups for p in g["params"] if p in inner.state]
    if per_param and not any("step" in s for s in states):
        for s in states:
            s["step"] = torch.zeros((), dtype=torch.float32)


def _sharded_state(model: TrainModel, *, loading: bool, fmt: str | None) -> dict:
    """The model's weights and optimizer state as a save writes them or a load requests them; `fmt`:
    the distributed optimizer's format (distributed_optimizer_format to save, the checkpoint's own
    to load)."""
    # An optimizer that has not stepped yet has no state: a save writes zero moments so that the
    # checkpoint has the keys a load asks for, and a load needs them to load into (megatron's
    # float16/fp32 optimizers create them themselves when loading; its distributed optimizer
    # reads every state's step first, distrib_optimizer.py state_dict; optimizer_state.py reads
    # into them in place).
    for opt in megatron_optimizers(model.optimizer):
        _init_unstepped_state(opt)
    state = dist_io.model_sharded_state(model.modules)
    if fmt == FULLY_RESHARDABLE:
        state["optimizer"] = optimizer_state.sharded_state(model.optimizer, state)
    else:  # no distributed optimizer, or an older checkpoint's dp_reshardable state
        metadata = {"distrib_optim_sharding_type": fmt} if fmt else None
        state["optimizer"] = model.optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
    return state


def _torch_optimizer_states(state) -> list[dict]:
    """The torch optimizer state dicts ({"state", "param_groups"}) inside a loaded megatron
    optimizer state: one for a plain optimizer, one per part of a ChainedOptimizer, nested
    under "optimizer" for the mixed-precision one."""
    if not isinstance(state, dict):
        return []
    if "state" in state and "param_groups" in state:
        return [state]
    return [s for v in state.values() for s in _torch_optimizer_states(v)]


def _per_param_steps_from_groups(inner) -> None:
    """torch Adam's per-parameter step count after megatron's distributed optimizer loaded it.
    That optimizer saves the count in its param groups (distrib_optimizer.py state_dict, "for
    non-Apex/TE support") and sets it into every state on load, but its dp_reshardable parameter
    load then copies each state tensor, the step included, from the bucket state it read, where
    the 0-dim counts come back as the loading template's (0 here): Adam would restart its bias
    correction. The param group's count is the saved one."""
    if not per_parameter_steps(inner):
        return
    for group in inner.param_groups:
        if "step" in group:
            for p in group["params"]:
                if "step" in inner.state.get(p, {}):
                    inner.state[p]["step"] = torch.tensor(float(group["step"] or 0), dtype=torch.float32)


def optimizer_moments(model: TrainModel) -> dict[str, torch.Tensor]:
    """Every tensor of the model's optimizer state ("o/g/i/exp_avg": optimizer o of a
    ChainedOptimizer, param group g, parameter i), the step counts as tensors too. For tests and
    gpu_check: two models built alike name the same moments alike."""
    out = {}
    for o, opt in enumerate(megatron_optimizers(model.optimizer)):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            if "step" in group and not per_parameter_steps(inner):
                out[f"{o}/{g}/step"] = torch.tensor(float(group["step"] or 0))  # the fused Adams' count
            for i, p in enumerate(group["params"]):
                for key, value in inner.state.get(p, {}).items():
                    out[f"{o}/{g}/{i}/{key}"] = torch.as_tensor(value).detach().float().clone()
    return out


def _saved_after_a_step(opt_state: dict) -> bool:
    """Whether a loaded torch optimizer state dict comes from a stepped optimizer: megatron saves
    torch Adam's per-parameter count as `common_step` (optimizer.py sharded_state_dict), and the
    fused Adams' per-group count inside the param groups."""
    return "common_step" in opt_state["state"] or any(float(g.get("step", 0) or 0) > 0
                                                      for g in opt_state["param_groups"])


def save_model_state(model: TrainModel, path: Path) -> None:
    path.mkdir(exist_ok=True)  # every rank, inside the staging directory rank 0 made
    dist_io.write_dist_checkpoint(_sharded_state(model, loading=False, fmt=distributed_optimizer_format(model)), path)
    _drop_unstepped_state(model)
    if parallel.is_rank0():
        write_source_files(path, model.hf_cfg, model.hf_dir, family_name=model.family.name, critic=model.critic,
                           dtype=model.dtype)


def _steps_for_this_adam(model: TrainModel, opt_state) -> None:
    """The loaded param groups' step count in the form this Adam keeps it: the checkpoint may come
    from the other kind (TE's or Apex's FusedAdam on a GPU node, torch's Adam where neither imports).
    The fused ones save an int per group, and none before their first step, where megatron's load
    for torch's Adam reads one from every group (distrib_optimizer.py load_state_dict): 0, a fresh
    optimizer. torch's saves a float (the per-parameter count's .item()), which TE's kernel takes
    as an int."""
    per_param = any(per_parameter_steps(o.optimizer) for o in megatron_optimizers(model.optimizer))
    parts = [opt_state] if "optimizer" in opt_state else [opt_state[k] for k in sorted(opt_state)]
    for part in parts:
        for group in part["optimizer"]["param_groups"]:
            if per_param:
                group["step"] = float(group.get("step") or 0)
            elif "step" in group:
                group["step"] = int(group["step"])


def load_model_state(model: TrainModel, path: Path) -> None:
    """Weights and optimizer state of one model from its dist checkpoint, in the format the
    checkpoint records (saved_optimizer_format), whichever Adam wrote it and whichever loads it."""
    fmt = saved_optimizer_format(path) if has_distributed_optimizer(model) else None
    if has_distributed_optimizer(model) and fmt not in (FULLY_RESHARDABLE, DP_RESHARDABLE):
        what = f"in megatron's {fmt} format" if fmt else "not a distributed optimizer's"
        raise dist_io.CheckpointError(f"{path}: its optimizer state is {what}, which this distributed optimizer "
                                      "does not read")
    loaded = dist_io.load(path, _sharded_state(model, loading=True, fmt=fmt))  # any failure is a CheckpointError
    for chunk, key in zip(model.modules, [k for k in loaded if k.startswith("model")]):
        dist_io.load_module_state(chunk, loaded.pop(key))  # frees megatron's SwiGLU merges (a copy of each linear_fc1)
    for opt_state in _torch_optimizer_states(loaded["optimizer"]):
        if opt_state["state"] and not _saved_after_a_step(opt_state):
            # Saved before this optimizer's first step: zero moments and no step count (megatron
            # stores a per-parameter step only once it is non-zero), which torch's Adam refuses to
            # load. It was a fresh optimizer; it loads as one.
            opt_state["state"] = {}
    if fmt is not None:
        _steps_for_this_adam(model, loaded["optimizer"])
    with torch.no_grad():  # megatron copies into the main params, which may be views of the model's own
        if fmt == FULLY_RESHARDABLE:  # the parameter state is in place already; groups and steps
            optimizer_state.load_param_state(model.optimizer, loaded["optimizer"])
        else:
            model.optimizer.load_state_dict(loaded["optimizer"])
    for opt in megatron_optimizers(model.optimizer):
        _per_param_steps_from_groups(opt.optimizer)
    _drop_unstepped_state(model)




def at_layout(model: TrainModel, step: Callable[[], T]) -> Callable[[], T]:
    """`step` run at `model`'s layout (the critic's own, critic.parallel, or the actor's)."""
    def run() -> T:
        with model.layout:
            return step()
    return run


def saved_layout(config: dict, sub: str) -> dict:
    """The parallel section a model of a run's record ran at: the critic's own when it had one."""
    if sub == "critic" and ((config.get("critic") or {}).get("parallel")):
        return config["critic"]["parallel"]
    return config.get("parallel", {})


__all__ = ["DP_RESHARDABLE", "FULLY_RESHARDABLE", "at_layout", "distributed_optimizer_format",
           "has_distributed_optimizer", "load_model_state", "megatron_optimizers", "optimizer_moments",
           "per_parameter_steps", "resume_layout_problem", "save_model_state", "saved_layout",
           "saved_optimizer_format"]
