"""Benchmark: vapo-convert's peak memory and time, both directions, against the model's size.

Writes a synthetic HF model of a preset's shape (default qwen2.5-1.5b: 1.54B parameters, random
bf16 weights in 4 safetensors shards with an index, tied embeddings) under a temporary
directory, then runs, each in its own child process (a single process, TP=1):

    vapo-convert hf-to-mcore --hf HF --out MC
    vapo-convert mcore-to-hf --ckpt MC --out BACK

and a third child that only imports what the converter imports (the process baseline). Each
child's peak resident set comes from the kernel's accounting of that child (os.wait4's rusage,
ru_maxrss). Linux counts in it the resident memory of the process that started it (up to its
exec), so this script's own process imports nothing heavy: writing the synthetic model and the
final bitwise comparison of the export with the source (tensor by tensor) run in children too.

Printed per direction: wall time, peak RSS, and peak RSS / model bytes; the last line is
`ratio: <the larger of the two ratios>` (peak RSS / bytes of the model's safetensors).

Run: python -m benchmarks.convert [--preset qwen2.5-1.5b] [--shards 4] [--max-shard-mb 512] [--keep]
Needs about 3x the model's size of free disk under the work directory (removed at the end).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for the preset, from transformers' own model built on the meta
    device (no memory); the tied lm_head is not stored, as save_pretrained does."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg["tie_word_embeddings"]:
        shapes.pop("lm_head.weight", None)
    return shapes


def write_synthetic(hf_dir: Path, cfg: dict, shards: int) -> int:
    """Random bf16 weights (std 0.02) in `shards` safetensors files plus the index and
    config.json; returns the bytes of tensor data. Holds one shard at a time."""
    import torch
    from safetensors.torch import save_file

    shapes = hf_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values()) * 2
    hf_dir.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    names, weight_map, part, size = list(shapes), {}, {}, 0
    for i, name in enumerate(names):
        part[name] = (torch.randn(shapes[name], generator=gen) * 0.02).to(torch.bfloat16)
        size += part[name].nbytes
        if size >= total / shards or i == len(names) - 1:
            fname = f"model-{len(set(weight_map.values())) + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(hf_dir / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
            part, size = {}, 0
    (hf_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return total


def compare(src: Path, dst: Path) -> int:
    """Bitwise equality of every tensor, one at a time; returns the count."""
    import torch
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        return {k: d / v for k, v in json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].items()}

    a, b = index(src), index(dst)
    if set(a) != set(b):
        sys.exit(f"exported names differ: {sorted(set(a) ^ set(b))[:5]}")
    for name in a:
        with safe_open(a[name], "pt") as fa, safe_open(b[name], "pt") as fb:
            if not torch.equal(fa.get_tensor(name), fb.get_tensor(name)):
                sys.exit(f"{name} differs after the round trip")
    return len(a)


def _child_mode(argv: list[str]) -> bool:
    """The two jobs run in children: `--write-synthetic DIR PRESET SHARDS` prints the model's
    bytes; `--compare SRC DST` prints the number of equal tensors."""
    if argv[:1] == ["--write-synthetic"]:
        sys.path.insert(0, str(ROOT))
        from model_providers.presets import PRESETS

        out, preset, shards = Path(argv[1]), argv[2], int(argv[3])
        if preset not in PRESETS:
            sys.exit(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
        print(write_synthetic(out, PRESETS[preset](), shards))
        return True
    if argv[:1] == ["--compare"]:
        print(compare(Path(argv[1]), Path(argv[2])))
        return True
    return False


def run_child(args: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of one child process, which must succeed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage; ru_maxrss in KiB on Linux
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if proc.returncode != 0:
            sys.exit(f"child failed ({proc.returncode}): {' '.join(args)}\n{err.read()[-3000:]}")
        return seconds, usage.ru_maxrss * 1024, out.read()


def main() -> None:
    if _child_mode(sys.argv[1:]):
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-1.5b", help="a model_providers.presets name")
    p.add_argument("--shards", type=int, default=4, help="safetensors files of the synthetic HF model")
    p.add_argument("--max-shard-mb", type=int, default=512, help="mcore-to-hf's shard size (its memory bound)")
    p.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp dir under /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the written directories")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_convert_", dir=args.workdir))
    try:
        hf = work / "hf"
        _, _, out = run_child(["-m", "benchmarks.convert", "--write-synthetic", str(hf), args.preset, str(args.shards)])
        model_bytes = int(out.split()[-1])
        tied = json.loads((hf / "config.json").read_text())["tie_word_embeddings"]
        print(f"model: {args.preset} shape, {model_bytes / 2 / 1e9:.2f}B parameters, {model_bytes / 1e9:.2f} GB bf16 "
              f"in {args.shards} safetensors shards, tied embeddings: {tied}")

        _, base, _ = run_child(["-c", "import vapo_megatron.convert, vapo_megatron.weights.convert, "
                                "vapo_megatron.checkpoint.lazy_save, vapo_megatron.weights.from_checkpoint"])
        print(f"baseline (a process importing the converter): peak RSS {base / 1e9:.2f} GB")
        ratios = []
        for name, cmd in (
            ("hf-to-mcore", ["-m", "vapo_megatron.convert", "hf-to-mcore", "--hf", str(hf), "--out", str(work / "mc")]),
            ("mcore-to-hf", ["-m", "vapo_megatron.convert", "mcore-to-hf", "--ckpt", str(work / "mc"),
                             "--out", str(work / "back"), "--max-shard-mb", str(args.max_shard_mb)]),
        ):
            seconds, peak, _ = run_child(cmd)
            ratios.append(peak / model_bytes)
            print(f"{name}: {seconds:.1f} s, peak RSS {peak / 1e9:.2f} GB "
                  f"(baseline + {(peak - base) / 1e9:.2f} GB), peak RSS / model bytes = {ratios[-1]:.3f}")
        _, _, out = run_child(["-m", "benchmarks.convert", "--compare", str(hf), str(work / "back")])
        print(f"round trip bitwise equal: {out.split()[-1]} tensors")
        print(f"ratio: {max(ratios):.3f}")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
