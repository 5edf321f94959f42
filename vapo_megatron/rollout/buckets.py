"""Bounded, single-dtype buckets of named tensors for weight transfer.

A bucket is one flat uint8 buffer (reused from bucket to bucket) into which tensors are copied
back to back, plus (name, dtype, shape, byte range) records. One dtype per bucket: SGLang's
FlattenedTensorBucket views byte ranges as the tensor's dtype, and mixed dtypes would misalign
offsets. A caller that streams tensors therefore holds at most one bucket plus the tensor in
flight, which `MemoryMeter` measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: torch.Size
    start: int  # byte offset in the flat buffer
    end: int


class MemoryMeter:
    """Bytes a weight transfer holds right now, and the most it ever held."""

    def __init__(self) -> None:
        self.held = 0
        self.peak = 0

    def hold(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def drop(self, n: int) -> None:
        self.held -= n
        assert self.held >= 0, "MemoryMeter: dropped more bytes than held"


class FlatBucket:
    """A reusable flat buffer of `capacity_bytes` holding tensors of one dtype.

    The buffer is allocated on the first add (on that tensor's device) and kept for later
    buckets; a single tensor larger than the capacity gets a bucket of its own, sized to it.
    """

    def __init__(self, capacity_bytes: int, meter: MemoryMeter | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"bucket capacity_bytes={capacity_bytes} must be > 0")
        self.capacity = capacity_bytes
        self.meter = meter
        self.buffer: torch.Tensor | None = None  # uint8 [allocated bytes]
        self.entries: list[Entry] = []
        self.used = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def dtype(self) -> torch.dtype | None:
        return self.entries[0].dtype if self.entries else None

    def fits(self, tensor: torch.Tensor) -> bool:
        """True if `tensor` can join this bucket (an empty bucket takes anything)."""
        return self.can_take(nbytes(tensor), tensor.dtype)

    def can_take(self, n: int, dtype: torch.dtype) -> bool:
        """True if `n` more bytes of `dtype` can join this bucket (an empty bucket takes anything)."""
        if not self.entries:
            return True
        return dtype == self.dtype and self.used + n <= self.capacity

    def _ensure_buffer(self, need: int, device: torch.device) -> None:
        if self.buffer is not None and self.buffer.numel() >= need and self.buffer.device == device:
            return
        self._free_buffer()
        size = max(self.capacity, need)
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        if self.meter is not None:
            self.meter.hold(size)

    def _free_buffer(self) -> None:
        if self.buffer is not None and self.meter is not None:
            self.meter.drop(self.buffer.numel())
        self.buffer = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        # Copy straight into the flat buffer (no intermediate flattened copy).
        self.reserve(name, tensor.shape, tensor.dtype, tensor.device).copy_(tensor)

    def reserve(self, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Add an entry and return its place in the buffer (a contiguous view) for the caller to
        fill before the bucket is used: weight sync writes TP shards straight into it."""
        n = math.prod(shape) * dtype.itemsize
        if not self.can_take(n, dtype):
            raise ValueError(
                f"tensor {name!r} ({dtype}, {n} bytes) does not fit the bucket "
                f"({self.dtype}, {self.used}/{self.capacity} bytes used)"
            )
        if not self.entries:
            self._ensure_buffer(n, torch.device(device))
        assert self.buffer is not None
        view = self.buffer[self.used : self.used + n].view(dtype).view(shape)
        self.entries.append(Entry(name, dtype, torch.Size(shape), self.used, self.used + n))
        self.used += n
        return view

    def flat(self) -> torch.Tensor:
        """uint8 [used bytes]: a view of the filled part of the buffer."""
        assert self.buffer is not None and self.entries, "empty bucket"
        return self.buffer[: self.used]

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Views into the buffer; valid until the next clear()/add()."""
        assert self.buffer is not None
        return [(e.name, self.buffer[e.start : e.end].view(e.dtype).view(e.shape)) for e in self.entries]

    def clear(self) -> None:
        """Forget the entries and keep the buffer for the next bucket."""
        self.entries = []
        self.used = 0

    def release(self) -> None:
        """Forget the entries and free the buffer (the next add allocates a new one)."""
        self.clear()
        self._free_buffer()


def group_into_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], capacity_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream into consecutive lists of one dtype and at most `capacity_bytes` each
    (a single larger tensor forms a list of its own). Lists hold references, not copies."""
    if capacity_bytes <= 0:
        raise ValueError(f"bucket capacity_bytes={capacity_bytes} must be > 0")
    group: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, t in named_tensors:
        n = nbytes(t)
        if group and (t.dtype != group[0][1].dtype or used + n > capacity_bytes):
            yield group
            group, used = [], 0
        group.append((name, t))
        used += n
    if group:
        yield group
