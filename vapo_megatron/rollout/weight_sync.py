"""Megatron actor shards -> full HF tensors -> rollout engines, in place, with bounded memory.

Every rank runs `stream_weights` at the same point (it is collective):
  1. each pipeline stage walks its own exported parameters (weights/params.py, exported_params: global
     layer numbers, rows of the shared mapping table) in batches; a TP transport (tp_gather)
     brings every TP rank's shard of each parameter to the TP ranks that need full tensors:
     shared memory on the CPU, torch.distributed gather/all_gather otherwise;
  2. those ranks write the shards straight into their places in the HF tensors
     (model_providers/layouts.py, place_shard: q/k/v and gate/up split, vocab padding dropped), never building the
     full Megatron tensor. The place is the engine's own parameter when the engine lends it
     (engine.weight_slot: the embedded engine), else a slot of one flat single-dtype bucket
     (buckets.FlatBucket, default 1 GiB) handed to engine.load_bucket when the next tensor would
     not fit (SGLang engine groups make that a collective);
  3. stages take turns over the PP group: while stage s streams, each HF tensor is broadcast
     (a small header, then the tensor) to the other stages, one tensor at a time, but only when
     some other stage of this PP group holds an engine.
No rank ever holds a state dict. What this code holds at once, measured by a MemoryMeter
(SyncStats.peak_bytes): the bucket, the transport's buffers (gathered shards of one parameter,
or a shared-memory staging area of 2 x the largest shard), and one HF tensor in flight for a
PP broadcast. SyncStats.bound() is the promise: one bucket plus the largest full tensor.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model_providers.layouts import hf_shapes, mcore_to_hf, place_shard
from vapo_megatron.mcore import parallel
from vapo_megatron.mcore.memory import free_cached_memory
from vapo_megatron.rollout.base import RolloutEngine
from vapo_megatron.rollout.buckets import FlatBucket, MemoryMeter, nbytes
from vapo_megatron.rollout.tp_gather import make_items, tp_gather

DEFAULT_BUCKET_BYTES = 1 << 30


@dataclass
class SyncStats:
    tensors: int = 0          # tensors this rank delivered to its engine
    bytes: int = 0            # their bytes
    buckets: int = 0          # buckets loaded into the engine
    sent: int = 0             # tensors this rank's stage broadcast to other stages
    peak_bytes: int = 0       # most bytes held at once (bucket, transport buffers, tensor in flight)
    largest_tensor_bytes: int = 0  # the largest full tensor this rank saw (Megatron's, padded)
    bucket_bytes: int = 0     # the configured bound
    seconds: float = 0.0

    def bound(self) -> int:
        """The promised ceiling on peak_bytes: one bucket (a bucket grows to fit a single
        larger tensor) plus the largest full tensor (the transport's or broadcast's buffers)."""
        return max(self.bucket_bytes, self.largest_tensor_bytes) + self.largest_tensor_bytes


class _Sink:
    """Where this rank's HF tensors go: the engine's own parameters, a bucket, or nowhere."""

    def __init__(self, engine: RolloutEngine | None, bucket_bytes: int, meter: MemoryMeter, stats: SyncStats) -> None:
        self.engine, self.stats, self.meter = engine, stats, meter
        self.bucket = FlatBucket(bucket_bytes, meter) if engine is not None else None
        self.device = parallel.device()

    def slot(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """A contiguous tensor to write HF tensor `name` into (None: this rank holds no engine).
        Call commit() once it is written."""
        if self.engine is None:
            return None
        direct = self.engine.weight_slot(name, shape)
        if direct is not None:
            return direct
        n = math.prod(shape) * dtype.itemsize
        if not self.bucket.can_take(n, dtype):
            self.flush()
        return self.bucket.reserve(name, shape, dtype, self.device)

    def commit(self, slot: torch.Tensor) -> None:
        self.stats.tensors += 1
        self.stats.bytes += nbytes(slot)

    def flush(self) -> None:
        if self.bucket is not None and len(self.bucket):
            self.engine.load_bucket(self.bucket)
            self.stats.buckets += 1
            self.bucket.clear()

    def close(self) -> None:
        self.flush()
        if self.bucket is not None:
            self.bucket.release()


def _send_header(header, src: int) -> None:
    # Headers go over the PP wait group (gloo): a receiving stage waits here while the sending
    # stage loads buckets into its engine (a weight update), which is a CPU wait.
    parallel.broadcast_object_list([header], src=src, group=parallel.wait_group("pipeline"))


def _recv_header(src: int):
    box = [None]
    parallel.broadcast_object_list(box, src=src, group=parallel.wait_group("pipeline"))
    return box[0]


def _stream_stage(model_chunks, family, hf_cfg, sink: _Sink, *, send: bool, src: int, group, transport: str,
                  meter: MemoryMeter, stats: SyncStats) -> None:
    """This stage's weights into this rank's sink, and (send) broadcast to the other stages."""
    from vapo_megatron.weights.params import exported_params

    items = make_items(list(exported_params(model_chunks, family, hf_cfg, experts=False)), parallel.tp_size())
    stats.largest_tensor_bytes = max([stats.largest_tensor_bytes] + [it.full_bytes() for it in items])
    need = sink.engine is not None or send
    gather = tp_gather(items, need=need, transport=transport, meter=meter)
    for k, batch in enumerate(gather.batches() if gather is not None else ()):
        gather.exchange(k, batch)
        if need:
            for it in batch:
                shards = gather.shards(it)
                names = it.row.hf_names(it.layer)
                for j, (name, shape) in enumerate(zip(names, hf_shapes(it.row, it.full_shape(), hf_cfg))):
                    out = sink.slot(name, shape, it.param.dtype)
                    # A broadcast sends the tensor as the model holds it, whatever the engine's dtype.
                    tmp = None
                    if send and (out is None or out.dtype != it.param.dtype):
                        tmp = torch.empty(shape, dtype=it.param.dtype, device=it.param.device)
                        meter.hold(nbytes(tmp))
                    outs: list = [None] * len(names)
                    outs[j] = tmp if tmp is not None else out
                    for r, shard in enumerate(shards):
                        place_shard(it.row, shard, r, len(shards), it.partition_dim, outs, hf_cfg)
                    if send:
                        _send_header((name, tuple(shape), it.param.dtype), src)
                        parallel.broadcast(outs[j], src=src, group=group)
                        stats.sent += 1
                    if out is not None:
                        if tmp is not None:
                            out.copy_(tmp)
                        sink.commit(out)
                    if tmp is not None:
                        meter.drop(nbytes(tmp))
                        del tmp
        gather.done(batch)
    if gather is not None:
        gather.close()
    _stream_experts(model_chunks, family, hf_cfg, sink, send=send, src=src, group=group, meter=meter, stats=stats)


def _stream_experts(model_chunks, family, hf_cfg, sink: _Sink, *, send: bool, src: int, group, meter: MemoryMeter,
                    stats: SyncStats) -> None:
    """This stage's routed experts (MoE), each gathered over TP and EP (params.expert_tensors:
    every rank of the stage takes part), into this rank's sink, and (send) to the other stages.
    Expert weights are many small tensors; they take the collective path whatever `transport`."""
    from vapo_megatron.weights.params import expert_tensors

    need = sink.engine is not None or send
    for row, layer, full in expert_tensors(model_chunks, family, hf_cfg):
        meter.hold(nbytes(full))
        stats.largest_tensor_bytes = max(stats.largest_tensor_bytes, nbytes(full))
        for name, tensor in (mcore_to_hf(row, full, hf_cfg, layer) if need else ()):
            tensor = tensor.contiguous()
            if send:
                _send_header((name, tuple(tensor.shape), tensor.dtype), src)
                parallel.broadcast(tensor, src=src, group=group)
                stats.sent += 1
            out = sink.slot(name, tensor.shape, tensor.dtype)
            if out is not None:
                out.copy_(tensor)
                sink.commit(out)
        meter.drop(nbytes(full))


def _receive_stage(sink: _Sink, *, src: int, group, meter: MemoryMeter, stats: SyncStats) -> None:
    """Another stage's HF tensors, broadcast one at a time, into this rank's sink."""
    device = parallel.device()
    while (header := _recv_header(src)) is not None:
        name, shape, dtype = header
        out = sink.slot(name, torch.Size(shape), dtype)
        stats.largest_tensor_bytes = max(stats.largest_tensor_bytes, math.prod(shape) * dtype.itemsize)
        if out is not None and out.dtype == dtype:
            parallel.broadcast(out, src=src, group=group)
        else:
            tmp = torch.empty(shape, dtype=dtype, device=device)
            meter.hold(nbytes(tmp))
            parallel.broadcast(tmp, src=src, group=group)
            if out is not None:
                out.copy_(tmp)
            meter.drop(nbytes(tmp))
            del tmp
        if out is not None:
            sink.commit(out)


@torch.no_grad()
def stream_weights(
    model_chunks: list,
    family,
    hf_cfg: dict,
    engine: RolloutEngine | None,
    version: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    transport: str = "auto",
) -> SyncStats:
    """Push this actor's weights into every engine held by some rank (engine=None elsewhere).

    Collective over the whole model-parallel world; `version` (the train step) is recorded by
    the engines. transport: how TP shards travel (tp_gather.TRANSPORTS): "auto" uses shared
    memory for CPU tensors of a TP group on one host, else torch.distributed collectives.
    Returns this rank's statistics."""
    start = time.perf_counter()
    stats = SyncStats(bucket_bytes=bucket_bytes)
    pp, stage = parallel.pp_size(), parallel.pp_rank()
    group = parallel.pp_group() if pp > 1 else None
    wants = [engine is not None]
    if pp > 1:
        flags: list = [None] * pp
        parallel.all_gather_object(flags, engine is not None, group=parallel.wait_group("pipeline"))
        wants = flags
    meter = MemoryMeter()
    sink = _Sink(engine, bucket_bytes, meter, stats)
    if engine is not None:
        engine.begin_weight_update()
    for src_stage in range(pp):
        others_want = any(w for s, w in enumerate(wants) if s != src_stage)
        src = dist.get_global_rank(group, src_stage) if pp > 1 else -1
        if stage == src_stage:
            _stream_stage(model_chunks, family, hf_cfg, sink, send=others_want, src=src, group=group,
                          transport=transport, meter=meter, stats=stats)
            if others_want:
                _send_header(None, src)
        elif others_want:
            _receive_stage(sink, src=src, group=group, meter=meter, stats=stats)
    sink.close()
    stats.peak_bytes = meter.peak
    if engine is not None:
        engine.end_weight_update(version)
    # Every rank, engine or not: the gathered embedding/output shards (~1.5 GB at 32B) and the
    # bucket (1 GiB) stay in PyTorch's cache otherwise, on GPUs an engine shares (mcore/memory.py).
    free_cached_memory()
    stats.seconds = time.perf_counter() - start
    return stats
