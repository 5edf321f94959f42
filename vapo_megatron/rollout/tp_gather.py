"""TP shards of one pipeline stage's parameters, brought to the TP ranks that need full tensors.

Weight sync walks a stage's exported parameters in batches (the same batches on every TP rank).
`exchange(k, batch)` is collective over the TP group; afterwards `shards(item)` gives, on a rank
that needs full tensors, every TP rank's shard of that parameter in rank order, and the caller
places them into HF tensors (model_providers/layouts.py, place_shard) without concatenating anything.

Two transports:
  SharedMemoryGather  CPU tensors, whole TP group on one host (the CPU trainer). Each rank whose
                      shards another rank needs copies them into its own staging area in
                      /dev/shm; the ranks that need them map that area and read the shards in
                      place. The area has two halves used in turn, one TP barrier per batch:
                      while readers consume batch k, writers fill batch k+1. This replaces
                      gloo's TCP all-gather (about 0.4 GiB/s on the 2-core dev machine) by one
                      memory copy on the writer. Areas are kept for the next sync (freshly
                      mapped pages cost a page fault each, which dominated the copy); each holds
                      2 x the largest shard, which is at most one full tensor at TP >= 2.
                      free_staging() gives them back.
  CollectiveGather    torch.distributed gather / all_gather of one parameter per batch (NCCL on
                      GPUs, where it is fast; gloo when the TP group spans hosts).

A replicated parameter (not TP-sharded) needs no transport: every rank reads its own copy.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from model_providers.table import Row
from vapo_megatron.mcore import parallel
from vapo_megatron.rollout.buckets import MemoryMeter, nbytes

SHM_DIR = "/dev/shm"
TRANSPORTS = ("auto", "shm", "collective")


@dataclass(frozen=True, eq=False)
class GatherItem:
    """One exported parameter of this pipeline stage."""

    param: Tensor                # this rank's tensor (a TP shard when partition_dim is set)
    row: Row
    layer: int | None            # global layer number (None for embedding / final norm / head)
    partition_dim: int | None    # TP partition dim; None: replicated, every rank holds it whole
    tp: int

    @property
    def sharded(self) -> bool:
        return self.partition_dim is not None

    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.param.shape)
        if self.sharded:
            shape[self.partition_dim] *= self.tp
        return tuple(shape)

    def full_bytes(self) -> int:
        return nbytes(self.param) * (self.tp if self.sharded else 1)


def make_items(params: list[tuple[Tensor, Row, int | None]], tp: int) -> list[GatherItem]:
    items = []
    for param, row, layer in params:
        sharded = tp > 1 and getattr(param, "tensor_model_parallel", False)
        items.append(GatherItem(param.detach(), row, layer, param.partition_dim if sharded else None, tp))
    return items


class CollectiveGather:
    """One parameter per batch through torch.distributed; gathered shards live until done()."""

    def __init__(self, items: list[GatherItem], group, needs: list[bool], meter: MemoryMeter) -> None:
        self.items, self.group, self.needs, self.meter = items, group, needs, meter
        self.rank = dist.get_rank(group) if group is not None else 0  # group None: TP=1, nothing sharded
        self._shards: list[Tensor] | None = None

    def batches(self) -> list[list[GatherItem]]:
        return [[it] for it in self.items]

    def exchange(self, k: int, batch: list[GatherItem]) -> None:
        (it,) = batch
        self._shards = None
        if not it.sharded:
            return
        t = it.param.contiguous()
        readers = [r for r, need in enumerate(self.needs) if need]
        if len(readers) == 1:
            dst = readers[0]
            bufs = [torch.empty_like(t) for _ in range(it.tp)] if self.rank == dst else None
            if bufs is not None:
                self.meter.hold(it.full_bytes())
            parallel.gather(t, bufs, dst=dist.get_global_rank(self.group, dst), group=self.group)
        else:
            bufs = [torch.empty_like(t) for _ in range(it.tp)]
            self.meter.hold(it.full_bytes())
            parallel.all_gather(bufs, t, group=self.group)
        self._shards = bufs

    def shards(self, it: GatherItem) -> list[Tensor]:
        return [it.param] if not it.sharded else self._shards

    def done(self, batch: list[GatherItem]) -> None:
        if self._shards is not None:
            self.meter.drop(batch[0].full_bytes())
        self._shards = None

    def close(self) -> None:
        pass


@dataclass
class _Areas:
    needs: tuple[bool, ...]
    own: Tensor | None                # uint8 [2 * half]: this rank's staging (None: nobody reads it)
    peers: list[Tensor | None]        # the other ranks' staging, mapped here (None: not needed)


# (TP group's global ranks, half) -> areas kept between syncs. One entry per group.
_STAGING: dict[tuple, _Areas] = {}


def free_staging() -> None:
    """Unmap every staging area this process keeps (the others' mappings stay until they free)."""
    _STAGING.clear()


def _align(offset: int, to: int) -> int:
    return -(-offset // to) * to


class SharedMemoryGather:
    """Shards through shared memory; build with `shared_memory_gather` (collective)."""

    def __init__(self, items: list[GatherItem], group, needs: list[bool], areas: _Areas, half: int,
                 meter: MemoryMeter) -> None:
        self.items, self.group, self.needs, self.areas, self.half = items, group, needs, areas, half
        self.rank = dist.get_rank(group)
        self.meter = meter
        if areas.own is not None:
            meter.hold(areas.own.numel())  # held between syncs too; counted while a sync runs
        # Plan: consecutive items; the sharded ones packed into one half each batch, each shard
        # at an offset aligned to its element size. Every TP rank plans the same batches.
        # Readers wait while the first batch is staged, so batches start small (half / 16,
        # doubling up to half), and the layers go first: the embedding, often the largest
        # shard and first in model order, would otherwise fill the first batch alone.
        self.offset: dict[int, int] = {}
        self.plan: list[list[GatherItem]] = [[]]
        used, cap = 0, max(1, half // 16)
        for it in sorted(items, key=lambda it: it.layer is None):  # stable: model order otherwise
            if it.sharded:
                n, start = nbytes(it.param), _align(used, it.param.element_size())
                if start + n > cap and used > 0:
                    self.plan.append([])
                    start, cap = 0, min(half, 2 * cap)
                self.offset[id(it)] = start
                used = start + n
            self.plan[-1].append(it)
        self._k = 0

    def batches(self) -> list[list[GatherItem]]:
        return self.plan

    def _view(self, area: Tensor, it: GatherItem) -> Tensor:
        start = (self._k % 2) * self.half + self.offset[id(it)]
        return area[start : start + nbytes(it.param)].view(it.param.dtype).view(it.param.shape)

    def exchange(self, k: int, batch: list[GatherItem]) -> None:
        self._k = k
        staged = [it for it in batch if it.sharded]
        if not staged:
            return
        if self.areas.own is not None:
            for it in staged:
                self._view(self.areas.own, it).copy_(it.param)
        # After this barrier batch k is staged everywhere. Every rank finished reading batch k-1
        # before it staged batch k, so once past it, half (k+1) % 2 may be overwritten.
        parallel.barrier(group=self.group)

    def shards(self, it: GatherItem) -> list[Tensor]:
        if not it.sharded:
            return [it.param]
        return [it.param if r == self.rank else self._view(self.areas.peers[r], it) for r in range(it.tp)]

    def done(self, batch: list[GatherItem]) -> None:
        pass

    def close(self) -> None:
        # Readers may still read the last batch; a writer touches its area again only in the
        # next sync, after that sync's first TP collective, which readers reach when done.
        if self.areas.own is not None:
            self.meter.drop(self.areas.own.numel())


def _create_area(size: int) -> tuple[str | None, Tensor | None, str | None]:
    """(path, mapped uint8 tensor, error). The space is reserved up front (posix_fallocate), so
    a full /dev/shm fails here with a message instead of a SIGBUS mid-copy."""
    path = os.path.join(SHM_DIR, f"vapo-wsync-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return None, None, f"cannot create {path}: {e}"
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        return None, None, (f"cannot reserve {size} bytes in {SHM_DIR} ({e}); "
                            "free space there or use transport='collective'")
    os.close(fd)
    return path, torch.from_file(path, shared=True, size=size, dtype=torch.uint8), None


def tp_gather(items: list[GatherItem], *, need: bool, transport: str, meter: MemoryMeter):
    """The transport for one stage's stream (collective over the TP group), or None when no TP
    rank of the group needs full tensors. `need`: this rank needs them."""
    if transport not in TRANSPORTS:
        raise ValueError(f"weight sync transport={transport!r}; known: {TRANSPORTS}")
    tp = parallel.tp_size()
    if tp == 1:
        return CollectiveGather(items, None, [need], meter) if need else None
    group = parallel.tp_group()
    rank = dist.get_rank(group)
    ranks = tuple(dist.get_global_rank(group, r) for r in range(tp))
    half = max((nbytes(it.param) for it in items if it.sharded), default=0)
    cached = _STAGING.get((ranks, half))
    on_cpu = all(it.param.device.type == "cpu" for it in items)
    info = (socket.gethostname(), need, on_cpu, cached.needs if cached is not None else None)
    infos: list = [None] * tp
    parallel.all_gather_object(infos, info, group=group)
    needs = [i[1] for i in infos]
    if not any(needs):
        return None
    shm_ok = len({i[0] for i in infos}) == 1 and all(i[2] for i in infos) and half > 0
    if transport == "shm" and not shm_ok:
        raise ValueError("weight sync transport='shm' needs CPU tensors and the whole TP group on one host")
    if transport == "collective" or not shm_ok:
        return CollectiveGather(items, group, needs, meter)

    key = (ranks, half)
    if all(i[3] == tuple(needs) for i in infos):
        return SharedMemoryGather(items, group, needs, _STAGING[key], half, meter)
    for old in [k for k in _STAGING if k[0] == ranks]:  # same on every rank of the group
        del _STAGING[old]
    # Rank r writes when some other rank reads its shards; reads when it needs full tensors.
    writes = any(needs[o] for o in range(tp) if o != rank)
    path, own, error = _create_area(2 * half) if writes else (None, None, None)
    paths: list = [None] * tp
    parallel.all_gather_object(paths, (path, error), group=group)
    errors = [f"TP rank {r}: {e}" for r, (_, e) in enumerate(paths) if e]
    if errors:
        parallel.barrier(group=group)
        if path is not None:
            os.unlink(path)
        if transport == "shm":
            raise RuntimeError("weight sync shared-memory staging failed: " + "; ".join(errors))
        return CollectiveGather(items, group, needs, meter)
    peers = [None] * tp
    if need:
        peers = [torch.from_file(p, shared=True, size=2 * half, dtype=torch.uint8) if p and r != rank else None
                 for r, (p, _) in enumerate(paths)]
    parallel.barrier(group=group)  # everyone mapped what it reads: the names can go
    if path is not None:
        os.unlink(path)
    areas = _Areas(tuple(needs), own, peers)
    _STAGING[key] = areas
    return SharedMemoryGather(items, group, needs, areas, half, meter)
