"""vapo-convert: HF <-> Megatron checkpoints for the supported model families.

    vapo-convert hf-to-mcore --hf HF_DIR --out CKPT_DIR [--critic] [--tp N --pp N] [--dtype D]
    vapo-convert mcore-to-hf --ckpt CKPT_DIR --out HF_DIR [--tp N --pp N] [--max-shard-mb M]

Runs as a single process or under torchrun (world size = tp * pp * dp). The Megatron checkpoint
is a dist checkpoint (reshardable: written at one TP/PP, loads at another) that also holds the
HF config and tokenizer files under hf/, so mcore-to-hf needs nothing else.

Both directions stream; the model is built on the meta device and never held whole:
- hf-to-mcore: megatron's dist-checkpoint save asks for one tensor at a time, and each is read
  from the safetensors files only then (lazy_save.py);
- mcore-to-hf: the checkpoint is read in groups of at most --max-shard-mb (default 512) of
  tensors, each group written as one safetensors shard (checkpoint_stream.py); each pipeline
  stage's TP-rank-0 writes its own shards, global rank 0 the index and config files.
Peak memory is about the process baseline plus one group (mcore-to-hf) or one tensor
(hf-to-mcore); docs/conversion.md has the measured figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

# Files copied verbatim from the source HF directory (those that exist).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "generation_config.json",
)
META = "vapo.json"
# Largest safetensors shard that mcore-to-hf (and the trainer's HF export) writes; also the bound
# on the tensors held at once, since a shard is written from memory in one go.
DEFAULT_SHARD_BYTES = 512 << 20


def _source_dtype(hf_cfg: dict) -> str:
    # transformers 5 writes "dtype"; older config.json files write "torch_dtype".
    for key in ("dtype", "torch_dtype"):
        if key in hf_cfg and hf_cfg[key] is not None:
            return str(hf_cfg[key]).removeprefix("torch.")
    return "float32"


def _clean_cfg(hf_cfg: dict) -> dict:
    return {k: v for k, v in hf_cfg.items() if k != "_source"}


def write_source_files(ckpt_dir: Path, hf_cfg: dict, hf_dir: Path, *, family_name: str, critic: bool, dtype: str) -> None:
    """What mcore-to-hf needs besides the weights: hf/config.json, the tokenizer files under hf/,
    and vapo.json. The trainer calls this too (inside checkpoint_io.save's write_extra) so that
    its checkpoints export the same way."""
    (ckpt_dir / "hf").mkdir(exist_ok=True)
    with open(ckpt_dir / "hf" / "config.json", "w") as f:
        json.dump(_clean_cfg(hf_cfg), f, indent=2)
    for name in TOKENIZER_FILES:
        if (Path(hf_dir) / name).is_file():
            shutil.copy2(Path(hf_dir) / name, ckpt_dir / "hf" / name)
    with open(ckpt_dir / META, "w") as f:
        json.dump({"family": family_name, "critic": critic, "dtype": dtype, "source": str(hf_dir)}, f, indent=2)


def hf_to_mcore(hf_dir: Path, out: Path, *, critic: bool, tp: int, pp: int, dtype: str | None) -> Path:
    """Stream an HF directory into a dist checkpoint: the model exists only on the meta device;
    each parameter's tensor is read from the safetensors files when the writer asks for it
    (lazy_save.py) and dropped once written."""
    from model_providers import family_for, load_hf_config
    from model_providers.build import build_chunks, fresh_value_head
    from model_providers.family import torch_dtype
    from vapo_megatron import checkpoint_io, parallel
    from vapo_megatron.hf_export import unwrap
    from vapo_megatron.hf_import import HFImporter
    from vapo_megatron.lazy_save import LazySaveStrategy

    hf_cfg = load_hf_config(hf_dir)
    family = family_for(hf_cfg)
    dtype = dtype or _source_dtype(hf_cfg)
    parallel.init_distributed(tp, pp)
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
            makers[param.untyped_storage()] = lambda p=param, r=row, l=layer: importer.local_tensor(p, r, l)
    if left and parallel.is_rank0():
        print(f"{hf_dir} has no value head (score.*): {left} keep a fresh initialization", file=sys.stderr)

    def write_extra(tmp: Path) -> None:
        write_source_files(tmp, hf_cfg, hf_dir, family_name=family.name, critic=critic, dtype=dtype)

    total = sum(p.nbytes for c in chunks for p in c.parameters())
    with tqdm(total=total, unit="B", unit_scale=True, desc="hf-to-mcore", disable=not parallel.is_rank0()) as bar:
        strategy = LazySaveStrategy(makers, on_made=bar.update)
        return checkpoint_io.save(out, checkpoint_io.model_sharded_state(chunks), write_extra=write_extra,
                                  strategy=strategy)


def _export_config(hf_cfg: dict, family, *, critic: bool, dtype: str) -> dict:
    cfg = _clean_cfg(hf_cfg)
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


class _ShardWriter:
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


def _bounded_groups(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
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


def mcore_to_hf(ckpt: Path, out: Path, *, tp: int, pp: int, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Stream a dist checkpoint into an HF directory: the model exists only on the meta device;
    the checkpoint is read in groups of at most `max_shard_bytes`, each written as one shard."""
    from model_providers import family_for
    from model_providers.build import build_chunks
    from model_providers.family import torch_dtype
    from vapo_megatron import checkpoint_io, parallel
    from vapo_megatron.checkpoint_stream import iter_checkpoint_hf_groups

    checkpoint_io.require_checkpoint(ckpt)
    if not (ckpt / META).is_file() or not (ckpt / "hf" / "config.json").is_file():
        raise checkpoint_io.CheckpointError(f"{ckpt} lacks {META} or hf/config.json: it was not written by vapo-convert")
    meta = json.loads((ckpt / META).read_text())
    hf_cfg = json.loads((ckpt / "hf" / "config.json").read_text())
    family, critic, dtype = family_for(hf_cfg), meta["critic"], meta["dtype"]

    parallel.init_distributed(tp, pp)
    with torch.device("meta"):
        chunks = build_chunks(hf_cfg, params_dtype=torch_dtype(dtype), critic=critic, on_gpu=False)
    # DP replicas other than the first write nothing, so they read nothing (a TP group lies
    # within one DP replica: its ranks skip together).
    groups = (iter_checkpoint_hf_groups(ckpt, chunks, family, hf_cfg, critic=critic, max_bytes=max_shard_bytes)
              if parallel.dp_rank() == 0 else iter(()))
    return write_hf_dir(groups, family, hf_cfg, out, files_src=ckpt / "hf", critic=critic, dtype=dtype)


def export_hf_dir(chunks: list, family, hf_cfg: dict, out: Path, *, files_src: Path, critic: bool, dtype: str,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Collective over all ranks: a live (TP/PP-sharded) model into an HF directory, streamed
    through iter_hf_tensors in shards of at most `max_shard_bytes`. Used by the trainer."""
    from vapo_megatron.hf_export import iter_hf_tensors

    groups = _bounded_groups(iter_hf_tensors(chunks, family, hf_cfg, critic=critic), max_shard_bytes)
    return write_hf_dir(groups, family, hf_cfg, out, files_src=files_src, critic=critic, dtype=dtype)


def write_hf_dir(groups: Iterable[list[tuple[str, torch.Tensor]]], family, hf_cfg: dict, out: Path, *,
                 files_src: Path, critic: bool, dtype: str) -> Path:
    """Collective over all ranks. Each group of (HF name, tensor) becomes one safetensors shard,
    written by each pipeline stage's TP-rank-0 (of DP rank 0) as the group arrives; global rank 0
    writes the index, config.json, generation_config.json and the tokenizer files found in
    `files_src`. Everything goes to a temp directory renamed into place at the end, so a crash
    never leaves a half-written export under `out` (a failure on rank 0 removes the temp dir)."""
    from vapo_megatron import parallel

    out = Path(out).absolute()
    tmp = out.parent / f".{out.name}.tmp"
    writes = parallel.tp_rank() == 0 and parallel.dp_rank() == 0
    if parallel.is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if dist.is_initialized():
        parallel.barrier()
    try:
        writer = _ShardWriter(tmp, f"model-pp{parallel.pp_rank():03d}")
        with tqdm(unit="B", unit_scale=True, desc="mcore-to-hf", disable=not parallel.is_rank0()) as bar:
            for group in groups:  # every TP rank must iterate (the gathers are collective); one writes
                if writes:
                    writer.write(dict(group))
                bar.update(sum(t.nbytes for _, t in group))
                del group

        maps = [None] * dist.get_world_size() if dist.is_initialized() else None
        if dist.is_initialized():
            parallel.all_gather_object(maps, writer.weight_map)
        else:
            maps = [writer.weight_map]
        if parallel.is_rank0():
            _finish_hf_dir(tmp, out, maps, family, hf_cfg, files_src=files_src, critic=critic, dtype=dtype)
    except BaseException:
        if parallel.is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dist.is_initialized():
        parallel.barrier()
    return out


def _finish_hf_dir(tmp: Path, out: Path, maps: list, family, hf_cfg: dict, *, files_src: Path, critic: bool,
                   dtype: str) -> None:
    """Rank 0: index, config files and tokenizer into `tmp`, then `tmp` renamed to `out`."""
    weight_map = {k: v for m in maps for k, v in m.items()}
    total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    with open(tmp / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(tmp / "config.json", "w") as f:
        json.dump(_export_config(hf_cfg, family, critic=critic, dtype=dtype), f, indent=2)
    for name in TOKENIZER_FILES:
        if (Path(files_src) / name).is_file():
            shutil.copy2(Path(files_src) / name, tmp / name)
    if not (tmp / "generation_config.json").is_file():
        gen = {k: hf_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf_cfg and hf_cfg[k] is not None}
        with open(tmp / "generation_config.json", "w") as f:
            json.dump(gen, f, indent=2)
    old = out.parent / f".{out.name}.old"
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vapo-convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF model directory -> Megatron dist checkpoint")
    a.add_argument("--hf", type=Path, required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    a.add_argument("--critic", action="store_true", help="build the critic (trunk + value head from score.*, "
                   "or freshly initialized when the HF model has none)")
    a.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="parameter dtype (default: the config's dtype)")
    b = sub.add_parser("mcore-to-hf", help="Megatron checkpoint written by hf-to-mcore (or the trainer) -> HF directory")
    b.add_argument("--ckpt", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--max-shard-mb", type=int, default=DEFAULT_SHARD_BYTES >> 20,
                   help="largest safetensors shard, MiB; also bounds the tensors held in memory at once")
    for q in (a, b):
        q.add_argument("--tp", type=int, default=1, help="tensor parallel size of this run")
        q.add_argument("--pp", type=int, default=1, help="pipeline parallel size of this run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from vapo_megatron import parallel

    from vapo_megatron.checkpoint_io import CheckpointError
    from vapo_megatron.hf_import import HFCheckpointError

    args = parse_args(argv)
    try:
        if args.cmd == "hf-to-mcore":
            path = hf_to_mcore(args.hf, args.out, critic=args.critic, tp=args.tp, pp=args.pp, dtype=args.dtype)
        else:
            path = mcore_to_hf(args.ckpt, args.out, tp=args.tp, pp=args.pp, max_shard_bytes=args.max_shard_mb << 20)
        if parallel.is_rank0():
            print(f"wrote {path}")
    except (CheckpointError, HFCheckpointError) as e:  # bad input: one line naming the file
        raise SystemExit(f"vapo-convert: error: {e}") from None
    finally:
        parallel.destroy()


if __name__ == "__main__":
    main()
