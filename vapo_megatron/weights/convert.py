"""HF <-> Megatron checkpoint conversion, both ways streaming (vapo-convert's library part).

    hf_to_mcore(hf_dir, out, critic=..., tp=..., pp=..., dtype=...)   HF dir -> dist checkpoint
    mcore_to_hf(ckpt, out, tp=..., pp=...)                            dist checkpoint -> HF dir
    model_checkpoint(ckpt)                                            a trainer iter_N -> its actor/
    export_hf_dir(chunks, family, hf_cfg, out, ...)                   live model -> HF dir (trainer)

Runs as a single process or under torchrun (world size = tp * pp * dp). The Megatron checkpoint
is a dist checkpoint (reshardable: written at one TP/PP, loads at another) that also holds the
HF config and tokenizer files under hf/, so mcore-to-hf needs nothing else.

--out is checked before anything else happens (atomic.check_replaceable): it is written only
when it is new or empty, or, with overwrite=True, an earlier output of the same direction; never
the input or a directory that holds or lies inside it.

Both directions stream; the model is built on the meta device and never held whole:
- hf-to-mcore: megatron's dist-checkpoint save asks for one tensor at a time, and each is read
  from the safetensors files only then (checkpoint/lazy_save.py);
- mcore-to-hf: the checkpoint is read in groups of at most --max-shard-mb (default 512) of
  tensors, each group written as one safetensors shard (from_checkpoint.py); each pipeline
  stage's TP-rank-0 writes its own shards, global rank 0 the index and config files.
Peak memory is about the process baseline plus one group (mcore-to-hf) or one tensor
(hf-to-mcore); docs/conversion.md has the measured figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from model_providers import check_supported, read_hf_config
from model_providers.files import model_dir_problems
from vapo_megatron.checkpoint import dist_io
from vapo_megatron.config.layout import CLI_KEYS, check_layout
from vapo_megatron.mcore import parallel
from vapo_megatron.mcore.dtypes import dtype_name, torch_dtype
from vapo_megatron.mcore.models import build_chunks, unwrap
from vapo_megatron.runtime.atomic import CONVERT_HF_TO_MCORE, CONVERT_MCORE_TO_HF, TRAINER_EXPORT, check_replaceable
from vapo_megatron.weights.hf_read import HFCheckpointError
from vapo_megatron.weights.hf_write import DEFAULT_SHARD_BYTES, META, bounded_groups, write_hf_dir, write_source_files
from vapo_megatron.weights.params import iter_hf_tensors


def _require_whole(hf_dir: Path, *, weights: bool) -> None:
    """Damaged model files (a truncated shard, a corrupt tokenizer.json, which would be copied
    into the output as it is) are refused before the layout starts, naming the file; so are a
    tokenizer, chat template or generation config that parses but does not load."""
    from vapo_megatron.data.model_files import loading_problems

    problems = model_dir_problems(hf_dir, weights=weights, tokenizer=False)
    problems = problems or loading_problems(hf_dir)
    if problems:
        raise HFCheckpointError("; ".join(problems))


def _start(tp: int, pp: int, hf_cfg: dict, model_key: str) -> None:
    """The layout checked against the launch and the model (one-line errors), then started."""
    check_layout(parallel.launcher_env()[1], tp, pp, model=hf_cfg, model_key=model_key, keys=CLI_KEYS)
    parallel.init_distributed(tp, pp)


def hf_to_mcore(hf_dir: Path, out: Path, *, critic: bool, tp: int, pp: int, dtype: str | None,
                overwrite: bool = False) -> Path:
    """Stream an HF directory into a dist checkpoint: the model exists only on the meta device;
    each parameter's tensor is read from the safetensors files when the writer asks for it
    (lazy_save.py) and dropped once written."""
    from vapo_megatron.checkpoint.lazy_save import LazySaveStrategy
    from vapo_megatron.mcore.critic_model import fresh_value_head  # megatron-core: imported when used
    from vapo_megatron.weights.hf_read import HFImporter

    check_replaceable(out, CONVERT_HF_TO_MCORE, overwrite=overwrite, sources={"--hf": hf_dir})
    hf_cfg = read_hf_config(hf_dir)
    family = check_supported(hf_cfg)
    _require_whole(hf_dir, weights=True)
    dtype = dtype or dtype_name(hf_cfg)
    _start(tp, pp, hf_cfg, f"--hf {hf_dir}")
    with torch.device("meta"):
        chunks = build_chunks(hf_cfg, params_dtype=torch_dtype(dtype), critic=critic, on_gpu=False)
    importer = HFImporter(family, hf_cfg, hf_dir, critic=critic)
    importer.check(chunks)  # missing / truncated files, absent tensors, wrong shapes: before any write

    makers, left = {}, []
    for param, row, layer, local_name in importer.params(chunks):
        if importer.missing(row, layer):  # a critic from a causal LM: its value head starts fresh
            left.append(local_name)
            value = fresh_value_head(unwrap(chunks[-1]).config)[local_name.rsplit(".", 1)[-1]]
            makers[param.untyped_storage()] = lambda value=value, param=param: value.to(param.dtype)
        else:
            makers[param.untyped_storage()] = lambda p=param, r=row, layer=layer: importer.local_tensor(p, r, layer)
    if left and parallel.is_rank0():
        print(f"{hf_dir} has no value head (score.*): {left} keep a fresh initialization", file=sys.stderr)

    def write_extra(tmp: Path) -> None:
        write_source_files(tmp, hf_cfg, hf_dir, family_name=family.name, critic=critic, dtype=dtype)

    total = sum(p.nbytes for c in chunks for p in c.parameters())
    with tqdm(total=total, unit="B", unit_scale=True, desc="hf-to-mcore", disable=not parallel.is_rank0()) as bar:
        strategy = LazySaveStrategy(makers, on_made=bar.update)
        return dist_io.save(out, dist_io.model_sharded_state(chunks), writer=CONVERT_HF_TO_MCORE,
                            write_extra=write_extra, strategy=strategy)


def model_checkpoint(ckpt: Path) -> Path:
    """The model checkpoint that --ckpt names: itself, or the actor of a trainer checkpoint
    (run_dir/checkpoints/iter_N, which holds actor/, critic/ and state.json; said on stderr).
    A run's checkpoints/ directory is refused naming the form to give."""
    ckpt = Path(ckpt)
    if (ckpt / "state.json").is_file() and (ckpt / "actor").is_dir():
        if parallel.launcher_env()[0] == 0:  # before torch.distributed starts: the launcher's rank
            print(f"vapo-convert: {ckpt} is a trainer checkpoint: converting its actor, {ckpt / 'actor'} "
                  f"(give --ckpt {ckpt / 'critic'} for the critic)", file=sys.stderr, flush=True)
        return ckpt / "actor"
    iters = sorted(ckpt.glob("iter_*")) if ckpt.is_dir() else []
    if iters and not (ckpt / "metadata.json").exists():
        raise dist_io.CheckpointError(f"--ckpt {ckpt} is a run's checkpoints directory; give one checkpoint's model, "
                                      f"e.g. --ckpt {iters[-1] / 'actor'} (or .../critic)")
    return ckpt


def mcore_to_hf(ckpt: Path, out: Path, *, tp: int, pp: int, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                overwrite: bool = False) -> Path:
    """Stream a dist checkpoint into an HF directory: the model exists only on the meta device;
    the checkpoint is read in groups of at most `max_shard_bytes`, each written as one shard."""
    from vapo_megatron.weights.from_checkpoint import exported_items, iter_checkpoint_hf_groups

    check_replaceable(out, CONVERT_MCORE_TO_HF, overwrite=overwrite, sources={"--ckpt": ckpt})
    ckpt = model_checkpoint(ckpt)
    dist_io.require_checkpoint(ckpt)
    if not (ckpt / META).is_file() or not (ckpt / "hf" / "config.json").is_file():
        raise dist_io.CheckpointError(f"{ckpt} lacks {META} or hf/config.json: it was not written by vapo-convert")
    try:
        meta = json.loads((ckpt / META).read_text())
        critic, dtype = meta["critic"], meta["dtype"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise dist_io.CheckpointError(f"{ckpt / META} is unreadable ({type(e).__name__}: {e})") from None
    hf_cfg = read_hf_config(ckpt / "hf")
    family = check_supported(hf_cfg)
    _require_whole(ckpt / "hf", weights=False)

    _start(tp, pp, hf_cfg, f"--ckpt {ckpt}")
    with torch.device("meta"):
        chunks = build_chunks(hf_cfg, params_dtype=torch_dtype(dtype), critic=critic, on_gpu=False)
    # DP replicas other than the first write nothing, so they read nothing (a TP group lies
    # within one DP replica: its ranks skip together).
    groups = (iter_checkpoint_hf_groups(ckpt, chunks, family, hf_cfg, critic=critic, max_bytes=max_shard_bytes)
              if parallel.dp_rank() == 0 else iter(()))
    total = sum(i.nbytes for i in exported_items(chunks, family, hf_cfg, critic=critic))  # this rank's stage
    return write_hf_dir(groups, family, hf_cfg, out, files_src=ckpt / "hf", critic=critic, dtype=dtype,
                        writer=CONVERT_MCORE_TO_HF, total=total)


def export_hf_dir(chunks: list, family, hf_cfg: dict, out: Path, *, files_src: Path, critic: bool, dtype: str,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Collective over all ranks: a live (TP/PP-sharded) model into an HF directory, streamed
    through iter_hf_tensors in shards of at most `max_shard_bytes`. Used by the trainer."""
    groups = bounded_groups(iter_hf_tensors(chunks, family, hf_cfg, critic=critic), max_shard_bytes)
    return write_hf_dir(groups, family, hf_cfg, out, files_src=files_src, critic=critic, dtype=dtype,
                        writer=TRAINER_EXPORT)


__all__ = ["export_hf_dir", "hf_to_mcore", "mcore_to_hf", "model_checkpoint"]
