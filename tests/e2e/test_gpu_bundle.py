"""The air-gapped GPU node (docs/gpu_node.md): a node with Python 3.12 and torch and nothing else
gets the bundle of scripts/gpu_bundle.py, installs it with scripts/gpu_node_install.sh, and runs
vapo-check. Here the node is a fresh venv that sees only torch's closure (symlinked from this
environment), and the install runs with no index; the bundle's wheels come from the package index
as `make setup`'s do. What a GPU adds (CUDA) is not checked here: vapo-check runs with --cpu, and
this is the suite's run of vapo-check's CPU mode."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import venv
from pathlib import Path

from tests.distributed.test_gpu_check import CPU_ARGS, assert_cpu_mode_passes
from tests.helpers.train_runs import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_bundle  # noqa: E402


def _torch_only(site: Path) -> None:
    """site/: symlinks to torch and every distribution torch requires (their packages and
    dist-info folders), and nothing else of this environment."""
    site.mkdir()
    for name in gpu_bundle._closure(["torch"]):
        dist = importlib.metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)


def test_bundle_pins_follow_pyproject_and_leave_torch_to_the_node():
    pins = dict(p.split("==") for p in gpu_bundle.bundle_requirements())
    assert pins["megatron-core"] == "0.19.2" and pins["transformers"] == "5.19.0"
    assert not {"torch", "triton", "tensorboard", "pyarrow", "matplotlib"} & set(pins)
    assert not [n for n in pins if n.startswith("nvidia-")]


def test_bundle_installs_offline_beside_torch_and_vapo_check_runs(tmp_path):
    bundle = tmp_path / "bundle"
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bundle.py"), str(bundle)],
                          capture_output=True, text=True, timeout=600)
    # Without the package index the bundle cannot be made: a failure, as test_pins' resolution is.
    assert made.returncode == 0, made.stdout + made.stderr[-3000:]
    assert "MiB" in made.stdout
    node = tmp_path / "node"
    venv.EnvBuilder(with_pip=False).create(node)  # the node's python: pip comes from torch's side below
    site = tmp_path / "torch_site"
    _torch_only(site)
    pip_src = Path(importlib.metadata.distribution("pip").locate_file("pip"))
    (site / "pip").symlink_to(pip_src)
    purelib = next((node / "lib").glob("python3.*/site-packages"))
    (purelib / "node_torch.pth").write_text(f"{site}\n")
    python = node / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PYTHON": str(python), "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a node caches the bundle's bytecode like any install
    # The bare node does not have megatron-core: the test would prove nothing otherwise.
    bare = subprocess.run([str(python), "-c", "import torch, megatron.core"], env=env, capture_output=True, text=True)
    assert bare.returncode != 0 and "megatron" in bare.stderr
    installed = subprocess.run(["bash", str(bundle / "gpu_node_install.sh"), str(bundle)], env=env,
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stdout + installed.stderr[-3000:]
    assert "megatron-core 0.19.2 transformers 5.19.0 import" in installed.stdout
    # vapo-check's whole CPU mode (tests/distributed/test_gpu_check.py's assertions), from the bundle, where
    # the package is not installed: `python -m vapo_megatron.check`, as docs/gpu_node.md says.
    check = subprocess.run([str(python), "-m", "vapo_megatron.check", *CPU_ARGS], cwd=bundle / "vapo-megatron",
                           env={**env, "PYTHONPATH": str(bundle / "site")}, capture_output=True, text=True, timeout=900)
    assert_cpu_mode_passes(check)
