"""What a piece of code costs in tensor memory and checkpoint reads, measured on the CPU.

    with TensorBytes() as m:  ...   m.peak: the most bytes of tensor storage that code created and
                                    held at once (every aten op's new outputs, tracked until their
                                    storage is freed; views and in-place results of existing
                                    tensors are not new)
    with CheckpointReads() as r: .. r.payload: {tensor key: bytes} of stored tensor data that torch
                                    DCP read from a checkpoint (each stored chunk read, as its
                                    elements x element size); r.largest: the largest chunk
    with CheckpointWrites() as w: . w.staged: bytes of the tensors megatron's writer staged for this
                                    rank to write (filesystem_async.py prepare_write_data; on a GPU
                                    its preload_tensors copies each of them to the host)

Only tensors made through aten ops in the calling thread are seen: torch DCP's file reads
(torch.load of one stored chunk at a time) are not, which is why CheckpointReads counts them.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._seen:
                continue
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


class CheckpointReads:
    """Spies on torch DCP's FileSystemReader.read_data (megatron's load reads through it)."""

    def __enter__(self):
        from torch.distributed.checkpoint import FileSystemReader

        self.payload: dict[str, int] = {}
        self.largest = 0
        self._cls, self._orig = FileSystemReader, FileSystemReader.read_data
        spy = self

        def read_data(reader, plan, planner):
            md = reader.read_metadata().state_dict_metadata
            for index in {req.storage_index for req in plan.items}:
                item = md[index.fqn]
                if not hasattr(item, "chunks"):  # a bytes item (megatron's common state, objects)
                    continue
                chunk = next(c for c in item.chunks if tuple(c.offsets) == tuple(index.offset))
                nbytes = math.prod(chunk.sizes) * item.properties.dtype.itemsize
                spy.payload[index.fqn] = spy.payload.get(index.fqn, 0) + nbytes
                spy.largest = max(spy.largest, nbytes)
            return spy._orig(reader, plan, planner)

        FileSystemReader.read_data = read_data
        return self

    def __exit__(self, *exc):
        self._cls.read_data = self._orig
        return False


class CheckpointWrites:
    """Spies on megatron's FileSystemWriterAsync.prepare_write_data (every torch_dist save stages there)."""

    def __enter__(self):
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        self.staged = 0
        self._cls, self._orig = FileSystemWriterAsync, FileSystemWriterAsync.prepare_write_data
        spy = self

        def prepare_write_data(writer, plan, planner):
            out = spy._orig(writer, plan, planner)
            spy.staged += sum(t.nbytes for _, _, (_, tensors) in writer.write_buckets for _, t in tensors)
            return out

        FileSystemWriterAsync.prepare_write_data = prepare_write_data
        return self

    def __exit__(self, *exc):
        self._cls.prepare_write_data = self._orig
        return False


__all__ = ["CheckpointReads", "CheckpointWrites", "TensorBytes"]
