"""What the weight sync hands SGLang (rollout/sglang_engine.py): a bucket of tensors flattened as
SGLang's FlattenedTensorBucket, serialized as its update_weights_from_tensor reads it (CUDA IPC
handles on GPUs, shared memory on the CPU), and the group members' payloads in engine TP rank order."""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from vapo_megatron.rollout.buckets import FlatBucket
from vapo_megatron.rollout.engine_signals import spared_from_stop_signals


def to_flattened_bucket(bucket: FlatBucket | Sequence[tuple[str, torch.Tensor]]):
    """SGLang's FlattenedTensorBucket for one single-dtype bucket.

    From a FlatBucket the existing flat buffer is reused (no copy); from a list SGLang's own
    constructor concatenates the tensors."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    if isinstance(bucket, FlatBucket):
        meta = [
            FlattenedTensorMetadata(name=e.name, shape=e.shape, dtype=e.dtype, start_idx=e.start, end_idx=e.end,
                                    numel=e.end - e.start)
            for e in bucket.entries
        ]
        return FlattenedTensorBucket(flattened_tensor=bucket.flat(), metadata=meta)
    dtypes = {t.dtype for _, t in bucket}
    if len(dtypes) != 1:
        raise ValueError(f"a weight bucket must hold one dtype (got {sorted(map(str, dtypes))}): "
                         "mixed dtypes misalign FlattenedTensorBucket offsets")
    return FlattenedTensorBucket(named_tensors=list(bucket))


def serialize_flattened_bucket(fb, *, output_str: bool = False) -> bytes | str:
    """One engine TP rank's payload for load_format="flattened_bucket": the dict SGLang's
    weight updater reads ({"flattened_tensor", "metadata"}), serialized by MultiprocessingSerializer.

    CUDA tensors travel as CUDA IPC handles; SGLang's patched torch reductions must be active
    for that (they make the handle independent of the device index). The patch breaks CPU
    tensor serialization, so it is applied only for CUDA payloads. CPU tensors (SGLang's CPU
    engine) travel as named shared memory (torch's "file_system" strategy), not as a file
    descriptor: only the sender's own child processes may fetch one (multiprocessing's authkey),
    so a server started on its own (sglang_http) failed to load the update, and died of it."""
    import torch.multiprocessing as tmp
    from sglang.srt.utils import MultiprocessingSerializer

    flat = fb.get_flattened_tensor()
    if flat.is_cuda:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    payload = {"flattened_tensor": flat, "metadata": fb.get_metadata()}
    strategy = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system" if not flat.is_cuda else strategy)
    # The file_system strategy starts torch's torch_shm_manager helper at its first use, from this
    # thread, in the trainer's process group: born with the trainer's stop signals blocked (as the
    # engine's processes are), or a Ctrl-C to the group or Slurm's SIGTERM killed it and the next
    # weight sync failed ("no response from torch_shm_manager") or waited for ever.
    spared = spared_from_stop_signals() if not flat.is_cuda else contextlib.nullcontext()
    try:
        with spared:
            return MultiprocessingSerializer.serialize(payload, output_str=output_str)
    finally:
        tmp.set_sharing_strategy(strategy)


def order_by_engine_rank(entries: Sequence[tuple[int | None, bytes | str]], base_gpu_id: int | None) -> list:
    """The payloads of an engine group's members, in engine TP rank order.

    `entries[r]` = (CUDA device index of group member r, or None for a CPU payload; payload).
    SGLang TP rank i runs on GPU base_gpu_id + i and deserializes entry i: with CUDA payloads
    that must be the handle made on its own GPU (another GPU's handle would open memory across
    devices), so entry i is the payload made on GPU base_gpu_id + i, whatever the members'
    order. Device indices are those every process of the node sees (one CUDA_VISIBLE_DEVICES
    for the trainer and, inherited, for the engine's schedulers). CPU payloads, and engines not
    started by `colocated` (base_gpu_id None: an HTTP server), keep rank order."""
    gpus = [g for g, _ in entries]
    if base_gpu_id is None or all(g is None for g in gpus):  # CPU payloads, or an engine started elsewhere
        return [p for _, p in entries]
    want = list(range(base_gpu_id, base_gpu_id + len(entries)))
    if None in gpus or sorted(gpus) != want:
        raise RuntimeError(f"engine group payloads come from GPUs {gpus}, but the SGLang engine's TP ranks run on "
                           f"GPUs {want} (base_gpu_id={base_gpu_id}): each TP rank must get the CUDA IPC handle "
                           "made on its own GPU")
    by_gpu = dict(entries)
    return [by_gpu[g] for g in want]


