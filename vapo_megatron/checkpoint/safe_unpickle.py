"""No checkpoint file can run code when loaded: restricted unpickling under megatron dist checkpoints.

Every file this project loads is read without unrestricted pickle: HF weights and RNG states
are safetensors, configs and run state are JSON, and Megatron dist checkpoints go through the
restrictions below. What megatron-core 0.19.2's `torch_dist` format unpickles, and how each
is made safe (read in megatron/core/dist_checkpointing/{serialization,strategies/torch,
strategies/common}.py and torch/distributed/checkpoint/{filesystem,default_planner}.py):

1. `<ckpt>/.metadata`, the DCP index of every tensor and byte item: torch's
   `FileSystemReader.read_metadata` calls plain `pickle.load` on it, so a crafted `.metadata`
   runs code. The `pickle` name inside torch.distributed.checkpoint.filesystem is replaced by
   a module that forwards everything to `pickle` but loads through `MetadataUnpickler`, which
   resolves only DCP's own metadata classes (dataclasses and enums of
   torch.distributed.checkpoint.{metadata,planner,filesystem}), torch dtypes, torch.Size and
   a few layout helpers, and refuses every other global by name. Storage entries that point
   outside the checkpoint directory (absolute paths, '..') are refused too.
2. Non-tensor items inside `*.distcp` (megatron's `common_state`: optimizer param groups and
   step; layers' `_extra_state`): DCP's `DefaultLoadPlanner.load_bytes` calls
   `torch.load(value, weights_only=False)`. It is replaced by the same code with
   `weights_only=True` (torch's allow-listed unpickler; megatron-core registers its own few
   plain classes with it on import).
3. A legacy `<ckpt>/common.pt` (older megatron formats; this project never writes one):
   megatron's `load_common` calls `torch.load` without `weights_only`, which torch >= 2.6
   treats as True unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set. It is replaced by a
   version that passes `weights_only=True` explicitly, so no environment variable turns it off.

`install()` applies the three replacements; it is idempotent, and vapo_megatron.checkpoint.dist_io
calls it on import, so every load path (the trainer's resume, vapo-convert) is covered.
Refusals raise `pickle.UnpicklingError` naming the file and the refused global; the trainer's
resume treats that checkpoint as damaged and falls back to an older one.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import types

import torch

_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
    # Stand-ins megatron-core keeps for reading its older checkpoints (plain dataclasses).
    "megatron.core.dist_checkpointing.strategies.torch",
)
_TORCH_NAMES = {"Size", "device"}
_OTHER = {
    ("torch.serialization", "_get_layout"),  # layout by name (torch.strided)
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file: data classes only, any other global is refused."""

    def __init__(self, file, *, source: str = "checkpoint metadata"):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        obj = None
        if module in _DCP_MODULES:
            import importlib

            obj = getattr(importlib.import_module(module), name, None)
            if not (isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))):
                obj = None
        elif module == "torch" and (name in _TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)):
            obj = getattr(torch, name)
        elif (module, name) in _OTHER:
            obj = super().find_class(module, name)
        if obj is None:
            raise pickle.UnpicklingError(
                f"{self.source}: refused to unpickle {module}.{name}, which is not a checkpoint-metadata type "
                "(the file may have been crafted to run code)"
            )
        return obj


def _check_storage_paths(metadata, source: str) -> None:
    storage = getattr(metadata, "storage_data", None) or {}
    for index, info in storage.items():
        rel = getattr(info, "relative_path", "")
        if not isinstance(rel, str) or os.path.isabs(rel) or ".." in rel.split("/") or "\\" in rel:
            raise pickle.UnpicklingError(f"{source}: storage entry {getattr(index, 'fqn', index)!r} points outside "
                                         f"the checkpoint directory ({rel!r})")


class _RestrictedPickle(types.ModuleType):
    """Stands in for the `pickle` module inside torch.distributed.checkpoint.filesystem: dumps
    as pickle does; loads through MetadataUnpickler."""

    def __init__(self):
        super().__init__("pickle")

    def __getattr__(self, name):
        return getattr(pickle, name)

    @staticmethod
    def load(file, **kwargs):
        source = getattr(file, "name", "checkpoint .metadata")
        metadata = MetadataUnpickler(file, source=str(source)).load()
        _check_storage_paths(metadata, str(source))
        return metadata

    @staticmethod
    def loads(data, **kwargs):
        return _RestrictedPickle.load(io.BytesIO(data))


def _load_bytes_weights_only(self, read_item, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes with weights_only=True (torch's code is the same otherwise)."""
    from torch.distributed.checkpoint._traverse import set_element

    obj = torch.load(value, weights_only=True)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


def _load_common_weights_only(checkpoint_dir: str):
    """megatron's legacy common.pt reader with weights_only=True, which no environment variable overrides."""
    from megatron.core.dist_checkpointing.mapping import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointingException(f"Common file {path} does not exist") from e


_installed = False


def install() -> None:
    """Apply the three replacements of the module docstring (idempotent)."""
    global _installed
    if _installed:
        return
    import megatron.core.dist_checkpointing.serialization as mcore_serialization
    import megatron.core.dist_checkpointing.strategies.common as mcore_common
    import torch.distributed.checkpoint.default_planner as dcp_planner
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    dcp_filesystem.pickle = _RestrictedPickle()
    dcp_planner.DefaultLoadPlanner.load_bytes = _load_bytes_weights_only
    mcore_common.load_common = _load_common_weights_only
    mcore_serialization.load_common = _load_common_weights_only
    _installed = True


__all__ = ["MetadataUnpickler", "install"]
