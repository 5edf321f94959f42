"""Write Hugging Face model directories: safetensors shards, index, config and tokenizer files.

    write_hf_dir(groups, ...)      collective: (HF name, tensor) groups -> one shard each, committed
                                   atomically (runtime/atomic.py) at the end
    write_source_files(dir, ...)   what a Megatron checkpoint carries so that mcore-to-hf needs
                                   nothing else: hf/config.json, the tokenizer files, vapo.json

Used by vapo-convert (convert.py) and by the trainer's checkpoints and final HF export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

from model_providers.files import MEGATRON_META
from model_providers.registry import clean
from vapo_megatron.mcore import parallel
from vapo_megatron.runtime.atomic import commit_dir, staging_dir, staging_path

# Files copied verbatim from the source HF directory (those that exist).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "generation_config.json",
)
META = MEGATRON_META  # model_providers/files.py: what marks a Megatron model checkpoint
# Largest safetensors shard that mcore-to-hf (and the trainer's HF export) writes; also the bound
# on the tensors held at once, since a shard is written from memory in one go.
DEFAULT_SHARD_BYTES = 512 << 20


def write_source_files(ckpt_dir: Path, hf_cfg: dict, hf_dir: Path, *, family_name: str, critic: bool,
                       dtype: str) -> None:
    """What mcore-to-hf needs besides the weights: hf/config.json, the tokenizer files under hf/,
    and vapo.json. vapo-convert's hf-to-mcore and the trainer's checkpoints both write them, so
    every Megatron checkpoint of the project exports the same way."""
    (ckpt_dir / "hf").mkdir(exist_ok=True)
    with open(ckpt_dir / "hf" / "config.json", "w") as f:
        json.dump(clean(hf_cfg), f, indent=2)
    for name in TOKENIZER_FILES:
        if (Path(hf_dir) / name).is_file():
            shutil.copy2(Path(hf_dir) / name, ckpt_dir / "hf" / name)
    with open(ckpt_dir / META, "w") as f:
        json.dump({"family": family_name, "critic": critic, "dtype": dtype, "source": str(hf_dir)}, f, indent=2)


def export_config(hf_cfg: dict, family, *, critic: bool, dtype: str) -> dict:
    """config.json of an export: the source's, with the dtype and the architecture of the export."""
    cfg = clean(hf_cfg)
    cfg["dtype"] = dtype
    cfg.pop("torch_dtype", None)  # superseded by "dtype"
    if critic:
        cfg["architectures"] = [family.token_classification_architecture]
        cfg["num_labels"] = 1
        cfg["id2label"] = {"0": "LABEL_0"}
        cfg["label2id"] = {"LABEL_0": 0}
    else:
        cfg["architectures"] = [family.causal_lm_architecture]
    return cfg


class ShardWriter:
    """Writes each group of tensors as one safetensors file; records the name -> file map."""

    def __init__(self, out: Path, prefix: str):
        self.out, self.prefix = out, prefix
        self.count = 0
        self.weight_map: dict[str, str] = {}

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        if not tensors:
            return
        fname = f"{self.prefix}-{self.count:05d}.safetensors"
        save_file(tensors, str(self.out / fname), metadata={"format": "pt"})
        self.weight_map.update({k: fname for k in tensors})
        self.count += 1


def bounded_groups(named: Iterable[tuple[str, torch.Tensor]],
                   max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) pairs in groups of at most `max_bytes` (a larger tensor alone)."""
    group, size = [], 0
    for name, tensor in named:
        if group and size + tensor.nbytes > max_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor.detach().to("cpu").contiguous()))
        size += tensor.nbytes
    if group:
        yield group


def write_hf_dir(groups: Iterable[list[tuple[str, torch.Tensor]]], family, hf_cfg: dict, out: Path, *,
                 files_src: Path, critic: bool, dtype: str, writer: str, total: int | None = None) -> Path:
    """Collective over all ranks. Each group of (HF name, tensor) becomes one safetensors shard,
    written by each pipeline stage's TP-rank-0 (of DP rank 0) as the group arrives; global rank 0
    writes the index, config.json, generation_config.json and the tokenizer files found in
    `files_src`. `total`: the bytes expected, for the progress bar. Everything goes to a staging
    directory committed into place at the end, so a crash never leaves a half-written export under
    `out` (a failure on rank 0 removes the staging directory). `writer` names the command for the
    export's marker: an existing `out` is replaced only when that command wrote it (runtime/atomic.py)."""
    out = Path(out).absolute()
    writes = parallel.tp_rank() == 0 and parallel.dp_rank() == 0
    tmp = staging_dir(out) if parallel.is_rank0() else staging_path(out)
    if dist.is_initialized():
        parallel.barrier()
    try:
        shards = ShardWriter(tmp, f"model-pp{parallel.pp_rank():03d}")
        with tqdm(total=total, unit="B", unit_scale=True, desc="mcore-to-hf", disable=not parallel.is_rank0()) as bar:
            for group in groups:  # every TP rank must iterate (the gathers are collective); one writes
                if writes:
                    shards.write(dict(group))
                bar.update(sum(t.nbytes for _, t in group))
                del group

        maps = [None] * dist.get_world_size() if dist.is_initialized() else None
        if dist.is_initialized():
            parallel.all_gather_object(maps, shards.weight_map)
        else:
            maps = [shards.weight_map]
        if parallel.is_rank0():
            _finish(tmp, maps, family, hf_cfg, files_src=files_src, critic=critic, dtype=dtype)
            commit_dir(tmp, out, writer=writer)
    except BaseException:
        if parallel.is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dist.is_initialized():
        parallel.barrier()
    return out


def _finish(tmp: Path, maps: list, family, hf_cfg: dict, *, files_src: Path, critic: bool, dtype: str) -> None:
    """Rank 0: index, config files and tokenizer into the staging directory."""
    weight_map = {k: v for m in maps for k, v in m.items()}
    total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    with open(tmp / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(tmp / "config.json", "w") as f:
        json.dump(export_config(hf_cfg, family, critic=critic, dtype=dtype), f, indent=2)
    for name in TOKENIZER_FILES:
        if (Path(files_src) / name).is_file():
            shutil.copy2(Path(files_src) / name, tmp / name)
    if not (tmp / "generation_config.json").is_file():
        gen = {k: hf_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if k in hf_cfg and hf_cfg[k] is not None}
        with open(tmp / "generation_config.json", "w") as f:
            json.dump(gen, f, indent=2)


__all__ = ["DEFAULT_SHARD_BYTES", "META", "ShardWriter", "TOKENIZER_FILES", "bounded_groups", "export_config",
           "write_hf_dir", "write_source_files"]
