"""Megatron actor shards -> full HF tensors -> bounded buckets -> rollout engines, in place.

Every rank runs `sync_weights` at the same point (it is collective):
  1. each pipeline stage streams its own layers as full HF tensors (hf_export.iter_hf_tensors:
     TP-gathered, global layer numbers, identical on every TP rank of the stage);
  2. stages take turns over the PP group: while stage s streams, each tensor is broadcast
     (a small header, then the tensor) to the other stages, one tensor at a time, but only when
     some other stage of this PP group holds an engine;
  3. ranks holding an engine copy each tensor into one flat single-dtype bucket
     (buckets.FlatBucket, default 1 GiB) and hand the bucket to the engine when the next tensor
     would not fit (engine.load_bucket; SGLang engine groups make that a collective).
No rank ever holds a state dict: the extra memory this code holds is one bucket plus the tensor in
flight, which a MemoryMeter measures (SyncStats.peak_bytes). Memory inside the TP gather of
hf_export (one parameter's shards and their concatenation) is outside this count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vapo_megatron import parallel
from vapo_megatron.rollout.base import RolloutEngine
from vapo_megatron.rollout.buckets import FlatBucket, MemoryMeter, nbytes

DEFAULT_BUCKET_BYTES = 1 << 30


@dataclass
class SyncStats:
    tensors: int = 0          # tensors this rank delivered to its engine
    bytes: int = 0            # their bytes
    buckets: int = 0          # buckets loaded into the engine
    sent: int = 0             # tensors this rank's stage broadcast to other stages
    peak_bytes: int = 0       # most bytes held at once (bucket buffer + tensor in flight)
    largest_tensor_bytes: int = 0
    bucket_bytes: int = 0     # the configured bound
    seconds: float = 0.0

    def bound(self) -> int:
        """The promised ceiling on peak_bytes: one bucket (a bucket grows to fit a single
        larger tensor) plus the largest tensor in flight."""
        return max(self.bucket_bytes, self.largest_tensor_bytes) + self.largest_tensor_bytes


class _Deliver:
    """Fills buckets on a rank that holds an engine; counts bytes on every rank."""

    def __init__(self, engine: RolloutEngine | None, bucket_bytes: int, stats: SyncStats) -> None:
        self.engine, self.stats = engine, stats
        self.meter = MemoryMeter()
        self.bucket = FlatBucket(bucket_bytes, self.meter) if engine is not None else None

    def arrive(self, t: torch.Tensor) -> None:
        n = nbytes(t)
        self.meter.hold(n)
        self.stats.largest_tensor_bytes = max(self.stats.largest_tensor_bytes, n)

    def leave(self, t: torch.Tensor) -> None:
        self.meter.drop(nbytes(t))

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.bucket is None:
            return
        if not self.bucket.fits(t):
            self.flush()
        self.bucket.add(name, t)
        self.stats.tensors += 1
        self.stats.bytes += nbytes(t)

    def flush(self) -> None:
        if self.bucket is not None and len(self.bucket):
            self.engine.load_bucket(self.bucket)
            self.stats.buckets += 1
            self.bucket.clear()

    def close(self) -> None:
        self.flush()
        if self.bucket is not None:
            self.bucket.release()
        self.stats.peak_bytes = self.meter.peak


def _send_header(header, src: int, group) -> None:
    dist.broadcast_object_list([header], src=src, group=group)


def _recv_header(src: int, group):
    box = [None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


@torch.no_grad()
def sync_weights(
    model_chunks: list,
    family,
    hf_cfg: dict,
    engine: RolloutEngine | None,
    version: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> SyncStats:
    """Push this actor's weights into every engine held by some rank (engine=None elsewhere).

    Collective over the whole model-parallel world; `version` (the train step) is recorded by
    the engines. Returns this rank's statistics."""
    from vapo_megatron.hf_export import iter_hf_tensors

    start = time.perf_counter()
    stats = SyncStats(bucket_bytes=bucket_bytes)
    pp, stage = parallel.pp_size(), parallel.pp_rank()
    group = parallel.pp_group() if pp > 1 else None
    wants = [engine is not None]
    if pp > 1:
        flags: list = [None] * pp
        dist.all_gather_object(flags, engine is not None, group=group)
        wants = flags
    deliver = _Deliver(engine, bucket_bytes, stats)
    if engine is not None:
        engine.begin_weight_update()
    device = parallel.device()
    for src_stage in range(pp):
        others_want = any(w for s, w in enumerate(wants) if s != src_stage)
        src = dist.get_global_rank(group, src_stage) if pp > 1 else dist.get_rank() if dist.is_initialized() else 0
        if stage == src_stage:
            for name, t in iter_hf_tensors(model_chunks, family, hf_cfg):
                deliver.arrive(t)
                deliver.add(name, t)
                if others_want:
                    t = t.contiguous()
                    _send_header((name, tuple(t.shape), t.dtype), src, group)
                    dist.broadcast(t, src=src, group=group)
                    stats.sent += 1
                deliver.leave(t)
                del t
            if others_want:
                _send_header(None, src, group)
        elif others_want:
            while (header := _recv_header(src, group)) is not None:
                name, shape, dtype = header
                t = torch.empty(shape, dtype=dtype, device=device)
                deliver.arrive(t)
                dist.broadcast(t, src=src, group=group)
                deliver.add(name, t)
                deliver.leave(t)
                del t
    deliver.close()
    if engine is not None:
        engine.end_weight_update(version)
    stats.seconds = time.perf_counter() - start
    return stats
