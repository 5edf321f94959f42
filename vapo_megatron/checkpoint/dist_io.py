"""Model weights as megatron dist checkpoints: written at one TP/PP layout, loadable at another.

A checkpoint directory is a megatron.core.dist_checkpointing directory (metadata.json, common.pt,
*.distcp) plus whatever files the caller adds (weights/hf_write.py's write_source_files: hf/ with
the HF config and tokenizer, and vapo.json). Writes are atomic (runtime/atomic.py): everything goes into a
staging directory beside the target, which is committed into place only once complete, so a
crash never leaves a half-written checkpoint under the target name.

The state is a dict of sharded state dicts; today {"model": ...} (or model0, model1, ... with
virtual pipeline stages). The trainer adds optimizer state, RNG and data position under other keys
of the same dict.

Loading never runs unrestricted pickle: importing this module installs safe_unpickle's
restrictions on megatron/torch DCP's unpickling (safe_unpickle.py).
"""

from __future__ import annotations

import queue
import re
import shutil
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from vapo_megatron.checkpoint import safe_unpickle
from vapo_megatron.mcore import parallel
from vapo_megatron.mcore.models import unwrap
from vapo_megatron.runtime.atomic import CONVERT_HF_TO_MCORE, commit_dir, staging_dir, staging_path

safe_unpickle.install()  # before any load: no checkpoint file may run code


class CheckpointError(ValueError):
    """A directory that is not a usable checkpoint; the message names it."""


def write_dist_checkpoint(sharded_state: dict, ckpt_dir: str | Path, strategy=None) -> None:
    """Collective: megatron's synchronous dist checkpoint save into `ckpt_dir` (no renaming).
    `strategy`: a megatron save strategy in place of its default torch_dist one (vapo-convert's
    streaming lazy_save.LazySaveStrategy).

    Megatron's torch_dist writer hands the write results of its writer threads back through a
    queue that it creates at the first save from a multiprocessing Manager: a spawned process
    that imports this program again (seconds of CPU and ~750 MB per rank), even though a
    synchronous save never lets the results leave this process. That process also outlives a
    rank killed by SIGKILL (an OOM kill, a node agent), orphaned. Every save here is synchronous,
    so megatron gets an in-process queue instead; asynchronous saves would need the Manager.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:  # megatron's lazily created module-level queue
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state, str(ckpt_dir), sharded_strategy=strategy)


def model_sharded_state(model_chunks: list) -> dict:
    """{"model": sd} for one chunk, {"model0": sd0, "model1": sd1, ...} with VPP (megatron's
    convention). Keys inside are global (layer offsets applied), so the chunking may differ
    between save and load."""
    sds = [unwrap(c).sharded_state_dict() for c in model_chunks]
    return {"model": sds[0]} if len(sds) == 1 else {f"model{i}": sd for i, sd in enumerate(sds)}


def _barrier():
    if dist.is_initialized():
        parallel.barrier()


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save(ckpt_dir: str | Path, sharded_state: dict, *, writer: str, write_extra: Callable[[Path], None] | None = None,
         strategy=None) -> Path:
    """Collective over all ranks. `write_extra(staging_dir)` runs on rank 0 before the commit. A
    failure on rank 0 removes the staging directory: nothing half-written stays behind. `writer`
    names the command for the directory's marker; it replaces only its own (atomic.commit_dir)."""
    target = Path(ckpt_dir).absolute()
    tmp = staging_path(target)
    if _rank0():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging_dir(target)
    _barrier()
    try:
        write_dist_checkpoint(sharded_state, tmp, strategy)
        if _rank0() and write_extra is not None:
            write_extra(tmp)
    except BaseException:
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    if _rank0():
        try:
            commit_dir(tmp, target, writer=writer)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    _barrier()
    return target


def require_checkpoint(ckpt_dir: str | Path) -> Path:
    """`ckpt_dir` as a dist checkpoint whose every storage file is whole (check_storage); else
    CheckpointError naming what is wrong. Every command that reads a checkpoint calls it first."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        raise CheckpointError(
            f"{path} is not a Megatron distributed checkpoint (no valid metadata.json); "
            "convert an HF model with `vapo-convert hf-to-mcore` first"
        )
    check_storage(path)
    return path


def check_storage(path: str | Path) -> None:
    """CheckpointError unless every storage file of the dist checkpoint at `path` is there and as
    long as its own metadata says (torch DCP's .metadata: each item's file, offset and length). A
    write cut off by a crash or a full disk, or a partial copy, is named file by file before any
    work, whichever part of the state the damage hits: a reader of the weights alone (vapo-eval,
    mcore-to-hf) would otherwise never read a cut optimizer half, which a resume refuses. Reads the
    metadata (restricted unpickling) and stats the files; reads no tensor."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data  # restricted unpickling
        needed: dict[str, int] = {}
        for info in storage.values():  # MetadataIndex -> _StorageInfo(relative_path, offset, length)
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # noqa: BLE001 - a missing, damaged or refused .metadata
        raise CheckpointError(f"{path}: {describe_failure(e)}") from None
    found = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            found.append(f"{file} is missing")
        elif file.stat().st_size < size:
            found.append(f"{file} is truncated ({file.stat().st_size} bytes, the metadata needs {size})")
    if found:
        raise CheckpointError(f"{path}: cannot load: {len(found)} damaged storage file{'s' if len(found) > 1 else ''}"
                              + "".join(f"; {f}" for f in found))


def load(ckpt_dir: str | Path, sharded_state: dict, *, part: bool = False) -> dict:
    """Collective. Returns the loaded state (same structure as `sharded_state`, plain tensors).

    part=True: `sharded_state` is only part of what the ranks hold (vapo-convert's mcore-to-hf
    reads a model in bounded groups of tensors). megatron's check that the ranks together request
    every shard of every tensor exactly once is skipped, and with it the only collective: each
    rank reads alone (torch DCP's no_dist load)."""
    path = require_checkpoint(ckpt_dir)
    try:
        sharded_state = local_extra_state_where_absent(path, sharded_state)
        return dist_checkpointing.load(sharded_state, str(path), validate_access_integrity=not part)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{path}: {describe_failure(e)}") from e


def _saved_keys(path: Path) -> set[str] | None:
    """The keys a dist checkpoint holds (ShardedObjects as 'key/shard_...'), None when its metadata
    cannot be read (the load then says so, naming the file)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)  # restricted unpickling
    except Exception:  # noqa: BLE001
        return None


def is_extra_state(key: str) -> bool:
    """A module's `_extra_state` (Transformer Engine's FP8 metadata; GroupedLinear has one per GEMM:
    `_extra_state1`, ...), as megatron names it in a sharded state dict."""
    return key.rsplit(".", 1)[-1].startswith("_extra_state")


def local_extra_state_where_absent(path: Path, sharded_state: dict) -> dict:
    """`sharded_state` with each `_extra_state` the checkpoint lacks kept as the module's own.

    Transformer Engine's modules add an `_extra_state` object to their sharded state dict (FP8
    scaling metadata; empty without FP8), megatron's local modules none. A checkpoint written by
    the local spec (vapo-convert, any CPU run, a GPU without TE) therefore lacks them, and
    megatron's strict load refused it in a TE model ("Missing key in checkpoint state_dict:
    ..._extra_state/...", issue 43 defect 3). FP8 is never on here, so a missing one is the fresh
    module's own; every other missing key still fails the load. The other direction needs nothing:
    keys the checkpoint has and the model does not ask for are not read."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject

    saved = _saved_keys(path)
    if saved is None:
        return sharded_state

    def keep_local(x):
        if isinstance(x, ShardedObject) and is_extra_state(x.key) and x.unique_key not in saved:
            return LocalNonpersistentObject(x.data)
        return x

    return dict_list_map_inplace(keep_local, sharded_state)


def shape_mismatches(ckpt_dir: str | Path, sharded_state: dict, *, vocab_size: int | None = None) -> list[str]:
    """Where this rank's part of a model differs from a checkpoint in global shape, or asks for a
    tensor the checkpoint lacks: one phrase each, naming the key and both shapes. [] when they
    match, or when the metadata cannot be read (the load then reports that as damage). A
    checkpoint of another model is a mismatch, not damage: an older checkpoint of the same run
    would not load either.

    `vocab_size`: the model's real vocabulary (HF config). The embedding and output layer differ
    in rows between TP sizes (padded_vocab_size); that is not a mismatch as long as both hold
    every real row (vocab_padding_only)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    try:
        saved = FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata  # restricted unpickling
    except Exception:  # noqa: BLE001 - no usable metadata: the load says so, naming the file
        return []
    found = []
    for sh in nested_values(sharded_state):
        if not isinstance(sh, ShardedTensor):
            continue
        if sh.key not in saved:
            found.append(f"{sh.key} (shape {list(sh.global_shape)} in the model) is not in the checkpoint")
        elif (tuple(saved[sh.key].size) != tuple(sh.global_shape)
              and not vocab_padding_only(sh, saved[sh.key].size, vocab_size)):
            found.append(f"{sh.key} is {list(saved[sh.key].size)} in the checkpoint, "
                         f"{list(sh.global_shape)} in the model")
    return found


def vocab_padding_only(sh, saved_shape, vocab_size: int | None) -> bool:
    """Whether a tensor's checkpoint and model shapes differ only in vocabulary padding rows.

    Megatron pads the vocabulary to a multiple of 128 x TP (mcore/models.py, padded_vocab_size),
    so a checkpoint written at another TP holds the embedding and output layer with more or fewer
    rows. Megatron flags exactly these tensors (and the optimizer state made from them) with
    `allow_shape_mismatch`: its load zero-fills the local shard and reads only the rows the
    checkpoint has (dist_checkpointing/strategies/torch.py). That is exact here because the
    padding rows are zero and stay zero: the import writes zeros (model_providers/layouts.py), no
    token id looks them up, and the log-softmax leaves the padding columns out
    (mcore/vocab_parallel.py, num_valid), so their gradient, Adam moments and weight decay are
    all zero. Rows the checkpoint lacks load as zeros, rows the model lacks are padding dropped.
    A tensor with fewer rows than the real vocabulary is another model."""
    model_shape, saved_shape = tuple(sh.global_shape), tuple(saved_shape)
    return (bool(sh.allow_shape_mismatch) and vocab_size is not None and len(model_shape) == len(saved_shape)
            and model_shape[1:] == saved_shape[1:] and min(model_shape[0], saved_shape[0]) >= vocab_size)


def describe_failure(e: BaseException) -> str:
    """One line for a failed load. torch DCP wraps each rank's error in a CheckpointException (a
    BaseException, which `except Exception` would let through) and folds a failed `.metadata`
    read into an AssertionError's text; a refusal by safe_unpickle is found in either."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    msg = str(e)
    refused = re.search(r"\S+: (refused to unpickle [\w.]+|"
                        r"storage entry .*? points outside the checkpoint directory \(.*?\))", msg)
    if refused:
        return f"refused to load (possibly crafted to run code): {refused.group(0)}"
    found = re.search(r"Unsupported global: GLOBAL (\S+)", msg)
    if found:  # torch's weights-only refusal spans many lines and suggests weights_only=False: keep the cause
        return (f"refused to load (possibly crafted to run code): a pickled item needs {found.group(1)}, "
                "which is not on torch's weights-only allow-list")
    lines = msg.strip().splitlines()
    return f"cannot load: {type(e).__name__}" + (f": {lines[-1]}" if lines else "")


def save_model(ckpt_dir: str | Path, model_chunks: list, *, write_extra: Callable[[Path], None] | None = None,
               writer: str = CONVERT_HF_TO_MCORE) -> Path:
    """A model alone, as hf-to-mcore writes it (the default `writer`)."""
    return save(ckpt_dir, model_sharded_state(model_chunks), writer=writer, write_extra=write_extra)


def load_model(ckpt_dir: str | Path, model_chunks: list) -> None:
    state = load(ckpt_dir, model_sharded_state(model_chunks))
    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
    for chunk, key in zip(model_chunks, keys):
        load_module_state(unwrap(chunk), state[key])


def load_module_state(module, loaded: dict) -> None:
    """`module.load_state_dict(loaded, strict=True)`, except that an `_extra_state` the loaded dict
    lacks stays the module's own. megatron's TEDotProductAttention leaves TE's attention
    `_extra_state` out of its sharded state dict (no FP8 with the unfused softmax) while
    `state_dict()` has it, so a strict load of any TE checkpoint into a TE model failed ("Missing
    key(s) in state_dict: ...core_attention._extra_state"); a local checkpoint has none at all
    (local_extra_state_where_absent). Every other missing or unexpected key still fails."""
    own = module.state_dict()
    loaded = dict(loaded) | {k: v for k, v in own.items() if is_extra_state(k) and k not in loaded}
    module.load_state_dict(loaded, strict=True)
