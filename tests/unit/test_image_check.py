"""containers/check_image.py, the NGC Dockerfile's first check, run against this venv's real metadata.

The venv stands in for an image: its torch (PyPI's 2.14.1, CUDA 13.0) is what a fitting base must
carry, so the check passes here; a pyproject pinning another torch, a PIP_CONSTRAINT file that
clashes with a pin, or a CUDA major other than sglang's must each fail the check, by name.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "containers" / "check_image.py"


def _run(*args: str, constraint: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}
    if constraint is not None:
        env["PIP_CONSTRAINT"] = constraint
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def _pyproject_pinning_torch(tmp_path: Path, version: str) -> Path:
    text = (REPO / "pyproject.toml").read_text()
    pin = f'"torch=={md.version("torch").split("+")[0]}"'
    assert pin in text, pin
    path = tmp_path / "pyproject.toml"
    path.write_text(text.replace(pin, f'"torch=={version}"'))
    return path


def test_this_venv_fits_the_pins():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"image torch {md.version('torch')}" in proc.stdout
    assert "PIP_CONSTRAINT is not set" in proc.stdout
    # sglang's nvidia-* requirements are stated one by one, read from its metadata
    for name in ("nvidia-cutlass-dsl", "nvidia-mathdx", "nvidia-ml-py", "cuda-python"):
        assert f"check_image: {name}: " in proc.stdout, proc.stdout


def test_another_torch_pin_fails_naming_both(tmp_path):
    proc = _run("--pyproject", str(_pyproject_pinning_torch(tmp_path, "2.14.0")))
    assert proc.returncode == 1, proc.stdout
    assert f"the image's torch is {md.version('torch')}" in proc.stderr and "torch==2.14.0" in proc.stderr, proc.stderr


def test_a_pre_release_of_the_pinned_torch_fails(tmp_path):
    # An NGC-style source build (2.X.0a0+git) shares major.minor with the pin but not its ABI.
    have = md.version("torch").split("+")[0]
    proc = _run("--pyproject", str(_pyproject_pinning_torch(tmp_path, have + "a0")))
    assert proc.returncode == 1 and f"torch=={have}a0" in proc.stderr, proc.stdout + proc.stderr


def test_a_conflicting_constraint_file_fails_by_name(tmp_path):
    numpy = md.version("numpy")
    cons = tmp_path / "constraint.txt"
    cons.write_text(f"# as an NGC image writes it\nnumpy==1.26.4\n-c nested.txt\ntqdm>={md.version('tqdm')}\n")
    proc = _run(constraint=str(cons))
    assert proc.returncode == 1, proc.stdout
    assert f"numpy: {cons}:2 constrains it to ==1.26.4, the install asks for =={numpy}" in proc.stderr, proc.stderr
    assert "tqdm" not in proc.stderr  # a constraint the pin satisfies is no conflict
    assert f"{cons}:3: '-c nested.txt' is not a requirement" in proc.stdout


def test_a_compatible_constraint_file_passes(tmp_path):
    cons = tmp_path / "constraint.txt"
    cons.write_text(f"numpy>=2\nsglang=={md.version('sglang')}\n")
    proc = _run(constraint=str(cons))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"PIP_CONSTRAINT ({cons}) checked" in proc.stdout


def test_cuda_major_comes_from_sglangs_requirements_and_is_checked(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "containers"))
    import check_image

    reqs = check_image.sglang_requirements()
    assert check_image.cuda_majors(reqs) == {13}  # sglang 0.5.23: flashinfer_python[cu13], nvshmem4py-cu13
    pins = check_image.project_pins(REPO / "pyproject.toml")
    problems: list[str] = []
    check_image.check_torch(pins, REPO / "pyproject.toml", {13}, problems)
    assert problems == []
    check_image.check_torch(pins, REPO / "pyproject.toml", {12}, problems)
    assert problems == [f"the image's torch is built for CUDA {check_image.torch_cuda()}, sglang "
                        f"{md.version('sglang')}'s wheels for CUDA 12 (the cuNN in its requirements)"]
