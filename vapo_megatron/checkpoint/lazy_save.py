"""Save a megatron dist checkpoint whose tensors are made one at a time, as the writer asks.

vapo-convert's hf-to-mcore builds the model on the meta device (shapes, no memory) so that
megatron's own `sharded_state_dict()` describes the checkpoint exactly as the trainer's would
(layer-stacked keys, TP sharding, vocabulary padding, the SwiGLU factory that splits fc1), and
gives, per parameter, a function that makes its real TP-local tensor. Two extension points of
torch DCP then stream:

- `LazySavePlanner.resolve_data` (torch's documented hook for producing a write item's data):
  the state dict holds meta tensors, each a view of one parameter (megatron detaches, reshapes,
  splits); the view's storage names the parameter, the parameter's function makes the real
  tensor, and the same view (size, stride, offset) is cut from it.
- torch's synchronous `FileSystemWriter`, one file per write item: it resolves an item, writes
  it and lets it go before the next. (Megatron's own writer, built for asynchronous saves,
  resolves every item up front; torch's writer with one file per rank keeps a reference to every
  tensor of the file until the file is complete, which is the whole model at TP=1.) The price is
  one .distcp file per parameter slice (about 12 per layer) instead of one per rank.

The result is megatron's torch_dist format (same .distcp files, .metadata, metadata.json and
common.pt): `dist_checkpointing.load` reads it at any TP/PP like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

# parameter storage (of a meta tensor) -> function making the real tensor of that parameter
Makers = dict[torch.UntypedStorage, Callable[[], Tensor]]


class LazySavePlanner(MCoreSavePlanner):
    """megatron's save planner, with each tensor write item made on demand by `makers`.

    The last parameter made is kept, since megatron's SwiGLU factory writes fc1 as two items
    (gate and up halves) cut from the same parameter. `on_made(nbytes)` reports each tensor made
    (the progress bar)."""

    def __init__(self, makers: Makers, on_made: Callable[[int], None] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.makers, self.on_made = makers, on_made
        self._last: tuple[torch.UntypedStorage, Tensor] | None = None

    def _made(self, storage: torch.UntypedStorage) -> Tensor:
        if self._last is not None and self._last[0] is storage:
            return self._last[1]
        self._last = None  # drop the previous tensor before making the next
        if storage not in self.makers:
            raise RuntimeError("a checkpoint tensor is not a view of any model parameter: cannot make it lazily")
        tensor = self.makers[storage]()
        if not tensor.is_contiguous() or tensor.storage_offset() != 0:
            tensor = tensor.contiguous().clone()  # the views below index the parameter's own layout
        if self.on_made is not None:
            self.on_made(tensor.nbytes)
        self._last = (storage, tensor)
        return tensor

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        view = self.lookup_object(write_item.index)  # meta: a view of a meta parameter
        if view.device.type != "meta":
            return super().resolve_data(write_item)
        base = self._made(view.untyped_storage())
        return base.as_strided(view.size(), view.stride(), view.storage_offset())


class LazySaveStrategy(TorchDistSaveShardedStrategy):
    """megatron's torch_dist save strategy (same backend name and version in metadata.json),
    writing synchronously through `LazySavePlanner` and torch's one-thread FileSystemWriter."""

    def __init__(self, makers: Makers, on_made: Callable[[int], None] | None = None):
        super().__init__()
        self.makers, self.on_made = makers, on_made

    def save(self, sharded_state_dict, checkpoint_dir: Path):
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
        planner = LazySavePlanner(self.makers, self.on_made, dedup_replicated_tensors=False,
                                  flatten_state_dict=False, flatten_sharded_tensors=False)
        writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=False, thread_count=1)
        dcp_save(pyt_state_dict, storage_writer=writer, planner=planner)


__all__ = ["LazySavePlanner", "LazySaveStrategy", "Makers"]
