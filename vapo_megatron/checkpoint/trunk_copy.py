"""The policy's trunk into a critic at another layout (critic.parallel), through a dist checkpoint.

At the actor's layout each rank copies its own shards (mcore/model.py copy_trunk). At another TP,
PP or EP a critic shard holds other slices of other layers, so the trunk goes through megatron's
dist checkpointing, which reshards: the actor's weights are saved at the actor's layout into the
run directory's scratch folder and read back at the critic's, every trunk tensor (all but the
value head, which keeps its fresh initialization: component 1). Once per run, after the warm
start; the folder is removed after.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from vapo_megatron.checkpoint import dist_io
from vapo_megatron.mcore import parallel
from vapo_megatron.mcore.model import TrainModel
from vapo_megatron.runtime.atomic import TRAINER_TRUNK

VALUE_HEAD = "value_head."


@torch.no_grad()
def copy_trunk_across(actor: TrainModel, critic: TrainModel, scratch: Path) -> int:
    """Collective. The actor's trunk into the critic, whatever their layouts; returns the number
    of tensors loaded on this rank. The optimizers' main copies follow the weights."""
    with parallel.role("actor"):
        dist_io.save(scratch, dist_io.model_sharded_state(actor.modules), writer=TRAINER_TRUNK)
    loaded_tensors = 0
    with parallel.role("critic"):
        state = dist_io.model_sharded_state(critic.modules)
        trunk = {key: {n: v for n, v in sd.items() if not n.startswith(VALUE_HEAD)} for key, sd in state.items()}
        loaded = dist_io.load(scratch, trunk)
        for key, module in zip(state, critic.modules):  # "model", or "model0", "model1", ... with VPP
            head = {n: v for n, v in module.state_dict().items() if n.startswith(VALUE_HEAD)}
            dist_io.load_module_state(module, {**loaded[key], **head})
            loaded_tensors += len(loaded[key])
        critic.optimizer.reload_model_params()
    with parallel.role("actor"):
        actor.optimizer.reload_model_params()
        parallel.barrier()
        if parallel.is_rank0():
            shutil.rmtree(scratch, ignore_errors=True)
        parallel.barrier()
    return loaded_tensors


__all__ = ["copy_trunk_across"]
