"""Everything a GPU node that has only Python 3.12 and torch needs to run this project, as one
folder to carry there (docs/gpu_node.md: the air-gapped runbook).

    python scripts/gpu_bundle.py DEST            # on a machine with this project's venv and an index
    python scripts/gpu_bundle.py --list          # the wheels it would fetch, name==version

DEST receives:
    wheels/                  the project's runtime dependencies that torch does not bring, as
                             CPython 3.12 manylinux x86_64 wheels (or pure-Python ones)
    requirements.txt         their name==version pins
    vapo-megatron.tar.gz     this checkout's tracked files at HEAD (git archive)
    gpu_node_install.sh      the install script the node runs (scripts/gpu_node_install.sh)

Which wheels: the closure of pyproject's dependencies, read from this venv's installed metadata
(so at the pinned versions), minus torch's own closure (the node has torch: a CUDA build matched to
its driver, which must not be replaced), minus OPTIONAL below. megatron-core, transformers and
their light dependencies come to about 47 MiB (numpy's and transformers' wheels are two thirds of
it); Transformer Engine and SGLang do not fit a 64 MiB bundle and are not needed to run the trainer
with its embedded engine (the local layer spec).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 << 20
# Optional at run time, and too large for the bundle: tensorboard (trainer.tensorboard=false),
# pyarrow (.parquet data; .jsonl needs nothing), matplotlib (benchmarks/plot_metrics.py only).
OPTIONAL = ("tensorboard", "pyarrow", "matplotlib")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def _closure(roots: list[str]) -> dict[str, str]:
    """normalized name -> installed version for roots and every requirement they pull in on this
    interpreter (markers evaluated here: the node runs the same Python on the same platform)."""
    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"gpu_bundle: {name} is not installed in this environment ({sys.prefix}); "
                             "run `make setup` first") from None
        seen[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def bundle_requirements() -> list[str]:
    """The pins of every wheel the bundle holds, sorted."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    roots = [Requirement(r).name for r in project]
    skip = set(_closure(["torch"])) | {canonicalize_name(n) for n in OPTIONAL}
    need = _closure([r for r in roots if canonicalize_name(r) not in skip])
    return sorted(f"{name}=={version}" for name, version in need.items() if name not in skip)


def download(pins: list[str], wheels: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "--platform", "any",
                    "--dest", str(wheels), *pins], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_bundle", description=__doc__.split("\n")[0])
    ap.add_argument("dest", nargs="?", help="output folder (created; must be empty or absent)")
    ap.add_argument("--list", action="store_true", help="print the pins and exit")
    args = ap.parse_args(argv)
    pins = bundle_requirements()
    if args.list:
        print("\n".join(pins))
        return 0
    if not args.dest:
        ap.error("give DEST, or --list")
    dest = Path(args.dest)
    if dest.exists() and any(dest.iterdir()):
        print(f"gpu_bundle: {dest} is not empty; give a new folder", file=sys.stderr)
        return 2
    (dest / "wheels").mkdir(parents=True, exist_ok=True)
    download(pins, dest / "wheels")
    (dest / "requirements.txt").write_text("\n".join(pins) + "\n")
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar.gz", "-o", str(dest / "vapo-megatron.tar.gz"),
                    "HEAD"], check=True)
    shutil.copy(ROOT / "scripts" / "gpu_node_install.sh", dest / "gpu_node_install.sh")
    files = sorted((p for p in dest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size, reverse=True)
    total = sum(p.stat().st_size for p in files)
    print(f"gpu_bundle: {dest}: {len(pins)} wheels + the source, {total / 2**20:.1f} MiB")
    if total > LIMIT_BYTES:
        print(f"gpu_bundle: over {LIMIT_BYTES >> 20} MiB; largest: "
              + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in files[:5]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
