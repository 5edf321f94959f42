"""The tensor allocations of one call, as torch's profiler records them (profile_memory=True): each
request to the allocator while the call runs, its size and the op that made it, temporaries freed
inside an op included. algo.py's GAE case and tests/unit/test_gae.py count them.

The individual allocations are read from the profiler's event tree (`experimental_event_tree`,
whose Allocation nodes the profiler's own memory timeline is built from): the public
key_averages() folds them into per-op net figures, in which a temporary freed before its op
returns counts nothing. Both are torch's private interfaces, pinned with torch in pyproject.toml.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    nbytes: int
    op: str  # the op that asked for it ("-" outside any op)


def allocations(fn: Callable[[], object]) -> tuple[object, list[Allocation]]:
    """(fn(), every allocation fn made, in order)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    found = []
    for node in walk(prof.profiler.kineto_results.experimental_event_tree()):
        if node.tag == _EventType.Allocation and node.extra_fields.alloc_size > 0:  # < 0: a free
            found.append(Allocation(node.extra_fields.alloc_size, node.parent.name if node.parent else "-"))
    return out, found


def summary(found: list[Allocation], unit_bytes: int) -> str:
    """'N allocations, X MiB = Y x unit (K of at least a tenth of a unit)'."""
    total = sum(a.nbytes for a in found)
    big = sum(a.nbytes >= unit_bytes // 10 for a in found)
    return (f"{len(found)} allocations, {total / 2**20:.1f} MiB = {total / unit_bytes:.2f} x [B, T] float32 "
            f"({big} of at least a tenth of one)")


__all__ = ["Allocation", "allocations", "summary"]
