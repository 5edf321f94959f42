"""One set of pins for the CPU/CI environment and the GPU install (README "GPU clusters").

- The CPU setup installs sglang with --no-deps (its full dependency set is the CUDA stack);
  every sglang requirement that *is* installed beside it must satisfy sglang's own specifier,
  and the project's pins of packages that sglang pins exactly must be those exact versions.
- `pip install '.[gpu]'` must resolve: pip's resolver is run in dry-run mode against the
  package index (no download of the large wheels is needed for most of them), and the versions
  it picks for torch and transformers must be the ones the CPU suite runs on. This test needs
  the package index; CI reaches it. Without it the test fails and says so: an unverified GPU
  install is a failure, not a skip.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from tests.helpers import early_pip

REPO = Path(__file__).resolve().parents[2]


def _project_pins() -> dict[str, str]:
    """{normalized name: version} of the exact (==) pins in pyproject's base dependencies."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for spec in project["dependencies"]:
        req = Requirement(spec)
        (op_version,) = [(s.operator, s.version) for s in req.specifier]
        assert op_version[0] == "==", f"pyproject.toml: {spec!r} is not an exact pin"
        pins[_norm(req.name)] = op_version[1]
    return pins


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _sglang_requirements() -> list[Requirement]:
    reqs = [Requirement(r) for r in md.requires("sglang") or []]
    env = {"extra": ""}
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def test_installed_packages_satisfy_sglangs_own_pins():
    bad = []
    for req in _sglang_requirements():
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            continue  # the CUDA stack: not installed on the CPU (setup uses --no-deps)
        if not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req.name} {have} installed, sglang {md.version('sglang')} requires {req.specifier}")
    assert not bad, "installed beside sglang at versions it does not accept:\n  " + "\n  ".join(bad)


def test_project_pins_equal_sglangs_exact_pins():
    pins = _project_pins()
    exact = {_norm(r.name): s.version for r in _sglang_requirements() for s in r.specifier if s.operator == "=="}
    shared = sorted(set(pins) & set(exact))
    assert {"torch", "transformers", "tokenizers"} <= set(shared), shared
    bad = [f"{n}: pyproject pins {pins[n]}, sglang pins {exact[n]}" for n in shared if pins[n] != exact[n]]
    assert not bad, "\n".join(bad)


def test_gpu_extra_resolves_with_the_cpu_pins(tmp_path):
    """`pip install '.[gpu]'` resolves (dry run), to the same torch/transformers as the CPU suite."""
    report = tmp_path / "report.json"
    # Started when the session started (tests/helpers/early_pip.py): its wait on the index overlaps
    # the other tests; run alone, the resolution runs here.
    returncode, out = early_pip.result(report)
    unreachable = ("Could not fetch URL", "NewConnectionError", "Temporary failure in name resolution",
                   "Network is unreachable", "No matching distribution found")
    if returncode != 0 and any(s in out for s in unreachable) and "ResolutionImpossible" not in out:
        raise AssertionError("the package index could not be reached, so the GPU install was not verified:\n"
                             f"{out[-3000:]}")
    assert returncode == 0, f"`pip install '.[gpu]'` does not resolve:\n{out[-5000:]}"
    picked = {_norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    for name in ("sglang", "transformer-engine", "megatron-core"):
        assert name in picked, f"{name} missing from the GPU resolution"
    differ = [f"{n}: GPU install gets {picked.get(n)}, CPU pin {v}" for n, v in _project_pins().items()
              if picked.get(n) != v]
    assert not differ, "the GPU install would run other versions than the suite tests:\n" + "\n".join(differ)


def test_container_recipe_keeps_the_images_torch(tmp_path):
    """containers/image_requirements.py (the NGC Dockerfile's step) never asks pip for torch or TE."""
    reqs, cons = tmp_path / "reqs.txt", tmp_path / "cons.txt"
    subprocess.run([sys.executable, str(REPO / "containers" / "image_requirements.py"), "--requirements", str(reqs),
                    "--constraints", str(cons)], check=True, capture_output=True)
    names = {_norm(Requirement(line).name) for line in reqs.read_text().splitlines()}
    assert not names & {"torch", "torchvision", "torchaudio", "transformer-engine", "apex"}, names
    assert {"megatron-core", "transformers", "safetensors"} <= names
    held = dict(line.split("==") for line in cons.read_text().splitlines())
    assert held["torch"] == md.version("torch")


def _sglang_cpu_pins() -> list[Requirement]:
    lines = (REPO / "scripts" / "sglang_cpu_requirements.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def test_sglang_cpu_engine_packages_are_pinned_and_whole():
    """scripts/sglang_cpu_requirements.txt (installed with --no-deps beside sglang): every line an exact
    pin, installed at that version, and every package one of them needs installed at a version it
    accepts, so --no-deps left no hole and fetched nothing unpinned."""
    bad = []
    for req in _sglang_cpu_pins():
        specs = [(s.operator, s.version) for s in req.specifier]
        if len(specs) != 1 or specs[0][0] != "==":
            bad.append(f"{req}: not an exact pin")
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            bad.append(f"{req}: not installed")
            continue
        if have != specs[0][1]:
            bad.append(f"{req}: {have} installed")
        for dep in map(Requirement, md.requires(req.name) or []):
            if dep.marker is not None and not dep.marker.evaluate({"extra": ""}):
                continue
            try:
                dep_have = md.version(dep.name)
            except md.PackageNotFoundError:
                bad.append(f"{req.name} needs {dep}: not installed")
                continue
            if not dep.specifier.contains(dep_have, prereleases=True):
                bad.append(f"{req.name} needs {dep}: {dep_have} installed")
    assert not bad, "scripts/sglang_cpu_requirements.txt:\n  " + "\n  ".join(bad)
