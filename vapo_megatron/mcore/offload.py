"""The trainer's state in host memory while the rollout engine generates (trainer.offload_during_rollout).

    state = Offloader([actor.model, critic.model])
    state.offload()        parameters and optimizer state -> host; DDP gradient buffers freed; device memory released
    state.onload()         back to the device, bitwise what left; the gradient buffers back as zeros
    host_bytes(models)     bytes a full offload needs on the host (Adam's moments counted before they exist)
    check_host_memory(models)  collective: every node has that much available (the smaller of
                           MemAvailable and the job's cgroup limit), else a ConfigError

Why storages: megatron's DDP keeps parameters (with the distributed optimizer) and gradients as
views into flat buffers (buffer.param_data, buffer.grad_data; param.main_grad is a view of the
latter), the distributed optimizer's fp32 main shards of fp32 parameters are views of the
parameter buffer, and Adam's moments are tensors of their own. Moving each *unique untyped
storage* once covers views and shared buffers exactly: its bytes are copied into a host tensor
(pinned on CUDA), then `storage.resize_(0)` frees the device block while every view keeps its
shape, stride and offset (they share the StorageImpl); onload resizes it back and copies the bytes
in. Nothing is re-created, so hooks, optimizer references and DDP buckets stay valid, and the
restored state is the same bytes. Dropping references instead would free nothing: every view
keeps its storage alive.

The DDP gradient buffers (buffer.grad_data, behind every param.main_grad) are freed without a
copy: they hold nothing worth keeping between steps (every training forward_backward zeroes them
first, mcore/schedule.py; checkpoints do not store them), and at the 32B layout they are a third
of the state, so copying them would cost a third of the pinned host memory and of the PCIe
traffic each way. onload gives them back zeroed, as megatron's own buffer offload does.

While offloaded the tensors have no memory behind them: reading one is undefined (a CPU read
segfaults). The trainer onloads before anything reads the models (trainer/trainer.py: scoring,
the updates, the weight sync, checkpoints, evals and exports all come after onload).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from vapo_megatron.mcore.memory import free_cached_memory

GIB = float(1 << 30)
# Host memory a node keeps beyond the pinned state: data, reward workers, the engine's host side.
HOST_HEADROOM_FRACTION = 0.10


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers under megatron's (a ChainedOptimizer chains several, each wrapping one)."""
    chain = getattr(optimizer, "chained_optimizers", None)
    megatron_opts = chain if chain is not None else [optimizer]
    return [getattr(o, "optimizer", o) for o in megatron_opts]


def state_tensors(model) -> Iterator[torch.Tensor]:
    """Every tensor of a TrainModel's state, views included (deduplicated by storage later)."""
    for chunk in model.chunks:  # megatron DDP: `buffers` is its list of flat param/grad buffers
        for buf in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            for t in (buf.param_data, buf.grad_data):
                if t is not None:
                    yield t
        module = getattr(chunk, "module", chunk)
        for p in module.parameters():
            yield p
            for g in (getattr(p, "main_grad", None), p.grad):
                if g is not None:
                    yield g
        yield from module.buffers()
    for opt in _inner_optimizers(model.optimizer):
        for group in opt.param_groups:  # fp32 main params (bf16 models) or the model's own (fp32)
            for p in group["params"]:
                yield p
                if p.grad is not None:
                    yield p.grad
        for per_param in opt.state.values():  # exp_avg, exp_avg_sq (and step, on the CPU)
            yield from (v for v in per_param.values() if isinstance(v, torch.Tensor))


def unique_storages(models, device: torch.device) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages on `device` behind the models' state, in a fixed order.
    Tensors elsewhere (Adam's step counts stay on the CPU beside CUDA moments) are left alone."""
    seen: dict[int, torch.UntypedStorage] = {}
    for model in models:
        for t in state_tensors(model):
            if t.device != device:
                continue
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen[st.data_ptr()] = st
    return list(seen.values())


def grad_buffer_storages(models) -> set[int]:
    """data_ptr of every DDP gradient buffer's storage (param.main_grad and the buckets are views
    of these): freed, not copied, by the offload."""
    return {buf.grad_data.untyped_storage().data_ptr()
            for model in models for chunk in model.chunks
            for buf in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))
            if buf.grad_data is not None and buf.grad_data.untyped_storage().nbytes()}


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 view of the whole storage: [nbytes]."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def host_bytes(models) -> int:
    """Host bytes a full offload of `models` needs: their device storages now but the gradient
    buffers (freed, not copied), plus Adam's two
    moments (each the size of its fp32 main parameter) for parameters that have none yet (torch
    creates them at the first step; right after the models are built there are none)."""
    device = _device(models)
    grads = grad_buffer_storages(models)
    total = sum(st.nbytes() for st in unique_storages(models, device) if st.data_ptr() not in grads)
    for model in models:
        for opt in _inner_optimizers(model.optimizer):
            if "betas" not in opt.defaults:  # not Adam: no moments to foresee
                continue
            # torch's Adam keeps its step count as a float32 scalar on the CPU: host memory already
            # on a GPU, a 4-byte storage of the state when the device is the CPU.
            step = 4 if device.type == "cpu" else 0
            for group in opt.param_groups:
                total += sum(2 * p.numel() * p.element_size() + step for p in group["params"]
                             if p.device == device and "exp_avg" not in opt.state.get(p, {}))
    return total


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """uint8 [nbytes] in host memory; pinned: page-locked by cudaHostRegister at its exact size.
    torch's own pinned allocator (pin_memory=True, CachingHostAllocator) rounds every block up to
    a power of two by default: a 24 GiB state would pin 32 GiB on each of a node's 8 ranks."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if pinned and nbytes:
        err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 1))  # 1: cudaHostRegisterPortable
        if err:
            raise RuntimeError(f"trainer.offload_during_rollout: pinning {nbytes:,} bytes of host memory failed "
                               f"(cudaHostRegister error {err})")
    return buf


def _release_host_buffer(buf: torch.Tensor | None, pinned: bool) -> None:
    if buf is not None and pinned and buf.numel():
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


def _device(models) -> torch.device:
    return next(models[0].chunks[0].parameters()).device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Offloader:
    """Moves the models' state between the device and one host buffer, kept between steps (pinning
    tens of GiB costs seconds): allocated at the first offload, sized for the whole state including
    Adam's moments to come (host_bytes), grown only if the state outgrows that."""

    def __init__(self, models: list):
        self.models = list(models)
        self.device = _device(self.models)
        self.pinned = self.device.type == "cuda"
        self.host: torch.Tensor | None = None   # uint8 [capacity]
        self.moved: list[tuple[torch.UntypedStorage, int, int]] = []  # (storage, host offset, nbytes)
        self.freed: list[tuple[torch.UntypedStorage, int]] = []  # gradient buffers: (storage, nbytes), no copy
        self.last: dict[str, tuple[int, float]] = {}  # direction -> (bytes, seconds) of the latest move

    @property
    def offloaded(self) -> bool:
        return bool(self.moved or self.freed)

    def offload(self) -> None:
        """Every unique device storage to the host but the gradient buffers, then all released on
        the device."""
        if self.offloaded:
            raise RuntimeError("offload(): the state is already in host memory")
        t0 = time.perf_counter()
        grads = grad_buffer_storages(self.models)
        every = unique_storages(self.models, self.device)
        storages = [st for st in every if st.data_ptr() not in grads]
        total = sum(st.nbytes() for st in storages)
        if self.host is None or self.host.numel() < total:
            self.close()  # the old buffer goes first: host memory holds one copy at a time
            # Sized for the moments Adam creates at its first step too: allocated (and pinned) once.
            self.host = _host_buffer(max(total, host_bytes(self.models)), self.pinned)
        self.freed = [(st, st.nbytes()) for st in every if st.data_ptr() in grads]
        offset = 0
        for st in storages:
            n = st.nbytes()
            # Asynchronous from pinned memory; the device is synchronized before any block is freed.
            self.host[offset:offset + n].copy_(_bytes_of(st), non_blocking=self.pinned)
            self.moved.append((st, offset, n))
            offset += n
        _sync(self.device)
        for st in [st for st, _, _ in self.moved] + [st for st, _ in self.freed]:
            st.resize_(0)  # the block goes back to the caching allocator; every view keeps its shape
        free_cached_memory()  # ... and from there to the driver, where the engine can take it
        self.last["offload"] = (total, time.perf_counter() - t0)

    def onload(self) -> None:
        """The storages back on the device, the same bytes."""
        if not self.offloaded:
            raise RuntimeError("onload(): the state is not in host memory")
        t0 = time.perf_counter()
        for st, offset, n in self.moved:
            st.resize_(n)
            _bytes_of(st).copy_(self.host[offset:offset + n], non_blocking=self.pinned)
        for st, n in self.freed:  # what the next backward would find after zero_grad_buffer
            st.resize_(n)
            _bytes_of(st).zero_()
        _sync(self.device)
        total = sum(n for _, _, n in self.moved)
        self.moved, self.freed = [], []
        self.last["onload"] = (total, time.perf_counter() - t0)

    def close(self) -> None:
        """Unpin and drop the host buffer (the state must be on the device)."""
        if self.offloaded:
            raise RuntimeError("close(): the state is still in host memory")
        _release_host_buffer(self.host, self.pinned)
        self.host = None

    def bandwidth_line(self) -> str:
        """One line: bytes moved each way and the host<->device bandwidth of the latest moves."""
        parts = []
        for way, arrow in (("offload", "device->host"), ("onload", "host->device")):
            if way in self.last:
                n, s = self.last[way]
                parts.append(f"{way} {n / GIB:.2f} GiB in {s:.3f} s ({arrow} {n / max(s, 1e-9) / 1e9:.2f} GB/s)")
        return "; ".join(parts)


# ---- host memory at start-up ------------------------------------------------------------------


UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat(path: Path, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.isdigit():
            return int(value)
    return 0


def cgroup_available_bytes(root: str | Path = "/sys/fs/cgroup",
                           self_cgroup: str | Path = "/proc/self/cgroup") -> int | None:
    """What this process's memory cgroups still allow, or None without a limit: the smallest
    limit - usage + inactive file cache (reclaimable, as MemAvailable counts it) over its cgroup
    and every ancestor (a job's limit often sits on the job's cgroup, above the step's). cgroup v2:
    memory.max, memory.current, memory.stat; v1: the memory controller's memory.limit_in_bytes,
    memory.usage_in_bytes, memory.stat (total_inactive_file). Paths injectable for tests."""
    root, best = Path(root), None
    for line in (_read(Path(self_cgroup)) or "").splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hier == "0" and controllers == "":
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        cgroup = base / rel.strip("/")
        for d in [cgroup, *[p for p in cgroup.parents if p.is_relative_to(base)]]:
            limit, usage = _read(d / files[0]), _read(d / files[1])
            if limit is None or usage is None or not limit.isdigit() or not usage.isdigit() or int(limit) >= UNLIMITED:
                continue  # "max", absent, or no limit at this level
            left = max(0, int(limit) - int(usage) + _stat(d / "memory.stat", files[2]))
            best = left if best is None else min(best, left)
    return best


def node_available_bytes(meminfo: str | Path = "/proc/meminfo") -> int:
    """MemAvailable of this node, else free physical pages (os.sysconf)."""
    for line in (_read(Path(meminfo)) or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_host_bytes(*, meminfo: str | Path = "/proc/meminfo", cgroup_root: str | Path = "/sys/fs/cgroup",
                         self_cgroup: str | Path = "/proc/self/cgroup") -> tuple[int, str]:
    """(bytes, what bounds them): the smaller of the node's MemAvailable and what the job's memory
    cgroup still allows; past the cgroup's limit the OOM killer ends the job however free the node is."""
    node = node_available_bytes(meminfo)
    job = cgroup_available_bytes(cgroup_root, self_cgroup)
    if job is not None and job < node:
        return job, "the job's cgroup memory limit"
    return node, "MemAvailable"


def host_memory_problem(per_rank: list[tuple]) -> str | None:
    """per_rank: (node name, bytes this rank offloads, the node's available bytes[, what bounds
    them]) of every rank. A message naming the setting, what each short node needs and has, or
    None when all fit."""
    need: dict[str, int] = {}
    have: dict[str, int] = {}
    bound: dict[str, str] = {}
    for node, n, avail, *source in per_rank:
        need[node] = need.get(node, 0) + n
        if node not in have or avail < have[node]:
            have[node], bound[node] = avail, (source[0] if source else "MemAvailable")
    short = [node for node in need if need[node] > (1 - HOST_HEADROOM_FRACTION) * have[node]]
    if not short:
        return None
    worst = max(short, key=lambda node: need[node] - have[node])
    ranks = sum(1 for node, *_ in per_rank if node == worst)
    return (f"trainer.offload_during_rollout=true needs {need[worst] / GIB:.1f} GiB of host memory on node {worst} "
            f"({need[worst]:,} bytes: the actor's and critic's parameters, gradient buffers and optimizer state of its "
            f"{ranks} rank(s), pinned), but the node has {have[worst] / GIB:.1f} GiB available ({bound[worst]}, "
            f"{have[worst]:,} bytes; {HOST_HEADROOM_FRACTION:.0%} of it is kept for the rest of the job)"
            + (f"; {len(short)} node(s) short" if len(short) > 1 else "")
            + ". Set trainer.offload_during_rollout=false (and lower rollout.sglang.mem_fraction: vapo-plan) "
              "or use nodes with more memory")


def check_host_memory(models) -> None:
    """Collective over the world (its gloo wait group): raises the same ConfigError on every rank
    when some node lacks the host memory to offload its ranks' state (host_memory_problem)."""
    from vapo_megatron.config import ConfigError
    from vapo_megatron.mcore import parallel

    mine = (socket.gethostname(), host_bytes(models), *available_host_bytes())
    group = parallel.wait_group()
    every: list = [None] * torch.distributed.get_world_size(group)
    parallel.all_gather_object(every, mine, group=group)
    problem = host_memory_problem(every)
    if problem:
        raise ConfigError(problem)


__all__ = ["HOST_HEADROOM_FRACTION", "Offloader", "grad_buffer_storages", "available_host_bytes",
           "cgroup_available_bytes", "check_host_memory", "host_bytes", "host_memory_problem", "node_available_bytes",
           "state_tensors", "unique_storages"]
