"""One rank of a launch inside this process, on torch's fake process group: vapo-plan builds each
rank's shard on the meta device this way (mcore/parallel.py re-exports init_fake; its destroy()
ends it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from vapo_megatron.config.layout import Layout, check_layout
from vapo_megatron.mcore import cpu_compat


def init_fake(world_size: int, rank: int, tp: int, pp: int, vpp: int | None = None, ep: int = 1) -> Layout:
    """Megatron's parallel state for one rank of a `world_size` launch, inside this one process,
    with torch's fake process group (collectives do nothing): vapo-plan builds each rank's shard on
    the meta device this way, with no GPU and no peers. Call `destroy()` before the next rank."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    layout = check_layout(world_size, tp, pp, vpp, ep=ep)
    if dist.is_initialized() or parallel_state.model_parallel_is_initialized():
        raise RuntimeError("init_fake: torch.distributed is already initialized in this process; call destroy() first")
    if not torch.cuda.is_available():
        cpu_compat.activate()  # megatron's RNG tracker and RoPE ask for CUDA
    dist.init_process_group(backend="fake", store=FakeStore(), rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        create_gloo_process_groups=False,  # the fake backend has no gloo counterpart
    )
    model_parallel_cuda_manual_seed(0)
    return layout


__all__ = ["init_fake"]
