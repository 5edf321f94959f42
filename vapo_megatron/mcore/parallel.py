"""Distributed start-up and every process group the trainer uses, in one place.

Reads the launcher's environment (torchrun's RANK/WORLD_SIZE/LOCAL_RANK first, then Slurm's
SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID), starts torch.distributed (NCCL on GPU, gloo on the
CPU), and initializes Megatron's model parallelism. Data parallelism is derived: DP = world_size / (TP * PP).
Other modules ask this module for groups, ranks and sizes and never reach into megatron's parallel_state
themselves; every collective of the project goes through the helpers at the end of this file.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from vapo_megatron.config.layout import Layout, check_layout, launcher_env
from vapo_megatron.mcore import cpu_compat, roles
from vapo_megatron.mcore.fake_ranks import init_fake  # noqa: F401  (vapo-plan asks parallel.init_fake)
from vapo_megatron.mcore.memory import free_cached_memory
from vapo_megatron.mcore.nccl_env import nccl_env
from vapo_megatron.mcore.roles import own_layout, role  # noqa: F401  (callers ask parallel.role)

DEFAULT_WAIT_TIMEOUT_S = 4 * 3600.0  # the wait groups' timeout unless given (rollout.wait_timeout_s)


def init_distributed(tp: int = 1, pp: int = 1, vpp: int | None = None, *, ep: int = 1, seed: int = 1234,
                     timeout_minutes: int = 30, wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
                     critic: tuple[int, int, int | None, int] | None = None) -> Layout:
    """Start torch.distributed and Megatron model parallelism; idempotent per process.

    timeout_minutes: the NCCL (GPU) or gloo (CPU) groups' timeout, for tensor traffic.
    wait_timeout_s: the CPU (gloo) wait groups' timeout (rollout.wait_timeout_s; see wait_group).
    critic: the critic's own (tp, pp, vpp, ep) on the same ranks (critic.parallel), None: the
    actor's; its groups are made first and entered with `with role("critic"):` (mcore/roles.py)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    rank, world_size, local_rank = launcher_env()
    layout = check_layout(world_size, tp, pp, vpp, ep=ep)
    nccl_env()  # every rank's NCCL settings, before any communicator (mcore/nccl_env.py)
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    else:
        cpu_compat.activate()

    if not dist.is_initialized():
        # A single process without a launcher rendezvouses in memory (HashStore): no TCP port, and
        # nothing written into os.environ, which every subprocess would inherit (a MASTER_PORT left
        # there by an in-process run made later single-process runs bind a port still in use).
        alone = world_size == 1 and "MASTER_PORT" not in os.environ
        if not alone:
            if "MASTER_PORT" not in os.environ:
                raise RuntimeError("MASTER_PORT is not set: launch with torchrun or the slurm/ scripts")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(
            backend="nccl" if on_gpu else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            **({"store": dist.HashStore()} if alone else {}),
        )
    if not parallel_state.model_parallel_is_initialized():
        if critic is not None and tuple(critic) != (tp, pp, vpp, ep):
            # The critic's own layout (critic.parallel): megatron's groups for it first, kept as the
            # critic's role, then megatron's state back to pristine for the actor's (mcore/roles.py).
            check_layout(world_size, *critic[:3], ep=critic[3])
            pristine = roles.snapshot()
            c_tp, c_pp, c_vpp, c_ep = critic
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=c_tp, pipeline_model_parallel_size=c_pp,
                virtual_pipeline_model_parallel_size=c_vpp, expert_model_parallel_size=c_ep,
                distributed_timeout_minutes=timeout_minutes)
            roles.keep("critic")
            roles.restore(pristine)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            expert_model_parallel_size=ep,  # expert TP stays megatron's default, TP
            distributed_timeout_minutes=timeout_minutes,
        )
        roles.keep("actor")
    model_parallel_cuda_manual_seed(seed)
    _init_wait_groups(wait_timeout_s, (tp, pp, vpp, ep))
    return layout


def destroy() -> None:
    from megatron.core import parallel_state

    global _ENGINE_GROUP, _WAIT_TIMEOUT_S
    _ENGINE_GROUP, _WAIT_TIMEOUT_S = None, None
    _WAIT_GROUPS.clear()
    roles.clear()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ---- groups, ranks and sizes (thin names over megatron's parallel_state) -------------------

def _ps():
    from megatron.core import parallel_state

    return parallel_state


def tp_group():
    return _ps().get_tensor_model_parallel_group()


def tp_rank() -> int:
    return _ps().get_tensor_model_parallel_rank()


def tp_size() -> int:
    return _ps().get_tensor_model_parallel_world_size()


def pp_group():
    return _ps().get_pipeline_model_parallel_group()


def pp_rank() -> int:
    return _ps().get_pipeline_model_parallel_rank()


def pp_size() -> int:
    return _ps().get_pipeline_model_parallel_world_size()


def dp_group():
    return _ps().get_data_parallel_group()


def dp_rank() -> int:
    return _ps().get_data_parallel_rank()


def dp_size() -> int:
    return _ps().get_data_parallel_world_size()


def ep_group():
    """The expert-parallel group: the ranks among which a MoE layer's routed experts are split."""
    return _ps().get_expert_model_parallel_group()


def ep_rank() -> int:
    return _ps().get_expert_model_parallel_rank()


def ep_size() -> int:
    return _ps().get_expert_model_parallel_world_size()


def agree_max(value: int) -> int:  # collective over DP: the largest `value` of any data-parallel rank
    t = torch.tensor([value], dtype=torch.int64)
    all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group())
    return int(t)


def model_parallel_group():
    return _ps().get_model_parallel_group()


def is_first_stage() -> bool:
    return _ps().is_pipeline_first_stage()


def is_last_stage() -> bool:
    return _ps().is_pipeline_last_stage()


def vp_size() -> int | None:
    """Virtual pipeline stages per rank (None: no interleaving)."""
    return _ps().get_virtual_pipeline_model_parallel_world_size()


def is_stage(first: bool, vp_stage: int | None) -> bool:
    """Whether (virtual) stage `vp_stage` of this rank is the pipeline's first (or last) one."""
    if first:
        return _ps().is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    return _ps().is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def dp_share(items: list) -> tuple[int, list]:
    """(index of the first item, items) of this DP rank's contiguous share: shares of
    ceil(len / dp) items in DP-rank order, so whole prompt groups stay on one rank when the
    length divides (rollouts, warm start), and the last shares may be short or empty (eval)."""
    per = -(-len(items) // dp_size())
    first = dp_rank() * per
    return first, items[first : first + per]


# ---- wait groups: CPU (gloo) groups for waits on another rank's generation ----------------
#
# A rank that holds no engine (or whose share is done) waits for the generating ranks: for a
# whole rollout or eval (30-60 minutes per iteration at 32B, docs/slurm.md), an engine start, or
# an engine's weight update. On an NCCL group that wait is a device collective: torch's
# all_gather_object all-gathers the sizes with NCCL and blocks on .item(), the NCCL watchdog
# aborts the job after the group's timeout, and the waiting kernel spins on the engine's GPU,
# time-sliced with its decode. So every such wait runs on one of these gloo groups (the ranks
# wait on the CPU), with a timeout sized to the job (rollout.wait_timeout_s); NCCL groups carry
# tensor traffic only. Peers (slime) wait on gloo the same way.

WAIT_GROUPS = ("world", "model_parallel", "data_parallel", "pipeline")
_WAIT_GROUPS: dict = {}
_WAIT_TIMEOUT_S: float | None = None


def _init_wait_groups(timeout_s: float, layout: tuple) -> None:
    """Collective. One gloo group per world / model-parallel / DP / PP group of megatron's layout."""
    global _WAIT_TIMEOUT_S
    if _WAIT_GROUPS and _WAIT_GROUPS["layout"] == layout:  # again after a re-init at another layout
        return
    _WAIT_GROUPS.clear()
    _WAIT_GROUPS["layout"] = layout
    if timeout_s <= 0:
        raise ValueError(f"rollout.wait_timeout_s={timeout_s} must be > 0")
    timeout = datetime.timedelta(seconds=timeout_s)
    _WAIT_GROUPS["world"] = dist.new_group(backend="gloo", timeout=timeout)
    mine = {"model_parallel": model_parallel_group(), "data_parallel": dp_group(), "pipeline": pp_group()}
    for name, group in mine.items():
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, dist.get_process_group_ranks(group), group=_WAIT_GROUPS["world"])
        blocks = sorted({tuple(r) for r in every})
        _WAIT_GROUPS[name], _ = dist.new_subgroups_by_enumeration([list(b) for b in blocks], timeout=timeout,
                                                                  backend="gloo")
    _WAIT_TIMEOUT_S = timeout_s


def wait_group(name: str = "world"):
    """The gloo counterpart of the world, model-parallel, data-parallel or pipeline group, with
    the wait timeout: for every wait that may span a generation, an engine start or a weight
    update, and for the small object exchanges around them."""
    if name not in WAIT_GROUPS:
        raise ValueError(f"wait_group({name!r}): one of {WAIT_GROUPS}")
    if not _WAIT_GROUPS:
        raise RuntimeError("init_distributed() has not run (no wait groups)")
    return _WAIT_GROUPS[name]


def wait_timeout_s() -> float:
    if _WAIT_TIMEOUT_S is None:
        raise RuntimeError("init_distributed() has not run (no wait groups)")
    return _WAIT_TIMEOUT_S


# ---- rollout engine groups ------------------------------------------------------------------

_ENGINE_GROUP = None


def init_engine_groups(size: int):
    """Collective. Splits every TP group into consecutive blocks of `size` ranks, one colocated
    rollout engine each (SGLang TP = size, engine TP rank i on the GPU of block rank i), and
    returns this rank's block. `size` must divide TP: a TP group's ranks are consecutive global
    ranks on one node (megatron's default rank order), so every block's GPUs are consecutive
    local devices of one node, as sglang.Engine(base_gpu_id=..., tp_size=size) expects.

    The groups are gloo with the wait timeout: they carry only small objects (CUDA IPC handles,
    an error string) and waits that span the owner's engine calls (weight updates, the barrier
    before its KV cache comes back); an NCCL communicator over the same GPUs would cost memory
    and put those waits on the device."""
    global _ENGINE_GROUP
    if tp_size() % size:
        raise ValueError(f"rollout.sglang.tp={size} must divide parallel.tp={tp_size()} "
                         "(engines live inside TP groups)")
    tp_groups = [None] * dist.get_world_size()
    all_gather_object(tp_groups, dist.get_process_group_ranks(tp_group()), group=wait_group())
    blocks = sorted({tuple(g[i : i + size]) for g in tp_groups for i in range(0, len(g), size)})
    _ENGINE_GROUP, _ = dist.new_subgroups_by_enumeration([list(b) for b in blocks], backend="gloo",
                                                         timeout=datetime.timedelta(seconds=wait_timeout_s()))
    return _ENGINE_GROUP


def engine_group():
    """This rank's engine group (after init_engine_groups)."""
    if _ENGINE_GROUP is None:
        raise RuntimeError("init_engine_groups() has not run")
    return _ENGINE_GROUP


# ---- collectives: every torch.distributed call of the project goes through these -----------
#
# NCCL moves CUDA tensors only, gloo CPU tensors only (on GPUs the process groups are NCCL, on the CPU gloo). Counts,
# metric sums and flags are small CPU tensors where they are made, so each helper moves its tensors to the device the
# group's backend needs, runs the collective and copies the result back into the caller's tensors, which stay where they
# were. A tensor already on the right device (logits, weights) is used as it is, without a copy. The object collectives
# and barrier are passed through: torch places their buffers itself (on the current CUDA device for NCCL). The suite
# fails when project code calls torch.distributed directly.

def backend_device(group=None) -> torch.device | None:
    """The device `group`'s backend communicates on: CUDA (the current device) for NCCL, the CPU
    for gloo; None for any other backend (a mixed "cpu:gloo,cuda:nccl" group takes either, and
    vapo-plan's fake group moves nothing), which leaves tensors where they are."""
    backend = dist.get_backend(group)
    if backend == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    if backend == dist.Backend.GLOO:
        return torch.device("cpu")
    return None


def _on(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    return tensor if device is None or tensor.device == device else tensor.to(device)


def _back(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src is not dst:
        dst.copy_(src)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """In place on `tensor` (any device), as torch.distributed.all_reduce; returns it."""
    work = _on(tensor, backend_device(group))
    dist.all_reduce(work, op=op, group=group)
    _back(tensor, work)
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In place on `tensor`; `src` is a global rank, as in torch.distributed.broadcast."""
    work = _on(tensor, backend_device(group))
    dist.broadcast(work, src=src, group=group)
    _back(tensor, work)
    return tensor


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Fills `tensor_list` (one tensor per group rank) as torch.distributed.all_gather."""
    device = backend_device(group)
    outs = [_on(t, device) for t in tensor_list]
    dist.all_gather(outs, _on(tensor, device), group=group)
    for dst, src in zip(tensor_list, outs):
        _back(dst, src)
    return tensor_list


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group=None) -> None:
    """torch.distributed.gather: `gather_list` on the global rank `dst` only."""
    device = backend_device(group)
    outs = None if gather_list is None else [_on(t, device) for t in gather_list]
    dist.gather(_on(tensor, device), outs, dst=dst, group=group)
    for out, src in zip(gather_list or [], outs or []):
        _back(out, src)


def _free_after_object_collective(group) -> None:
    """On an NCCL group torch stages an object collective in CUDA buffers (the receive buffer of
    all_gather_object is group size x the largest object) that its caching allocator then keeps;
    hand them back (mcore/memory.py) so a colocated engine can take the memory. Gloo groups
    (the wait groups) stage on the CPU."""
    if backend_device(group) is not None and backend_device(group).type == "cuda":
        free_cached_memory()


def all_gather_object(object_list: list, obj, group=None) -> None:
    dist.all_gather_object(object_list, obj, group=group)
    _free_after_object_collective(group)


def gather_object(obj, object_gather_list: list | None = None, dst: int = 0, group=None) -> None:
    dist.gather_object(obj, object_gather_list, dst=dst, group=group)
    _free_after_object_collective(group)


def broadcast_object_list(object_list: list, src: int, group=None) -> None:
    dist.broadcast_object_list(object_list, src=src, group=group)
    _free_after_object_collective(group)


def share_from_rank0(obj):
    """Collective: global rank 0's `obj` on every rank (a small picklable value)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(group=None) -> None:
    dist.barrier(group=group)
