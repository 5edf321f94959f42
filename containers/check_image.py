"""Checks a base image against the project's pins before containers/Dockerfile installs anything.

Run inside the image after `pip install --no-deps -e . sglang==<pin>` (so that sglang's declared
requirements can be read with importlib.metadata) and before any dependency is installed. It
never imports torch: versions come from package metadata and from torch/version.py, read as text.
Every problem is listed at once, then the script exits 1; on success it prints what it found.

1. torch, exactly. sglang-kernel, flashinfer and sgl-deep-gemm ship compiled extensions built
   against the *released* torch of sglang's pin (its C++ ABI) and one CUDA major (the `cuNN`
   extras and suffixes of sglang's requirements). Matching major.minor is not enough: NGC images
   usually carry a pre-release source build (a version such as 2.X.0a0+<git hash>), whose ABI the
   wheels were not built against. The image's torch must be the pyproject pin exactly (local tag
   such as +cu130 aside) and its CUDA major must be the one sglang's wheels are built for.
2. PIP_CONSTRAINT. NGC images point it at a constraint file (/etc/pip/constraint.txt) that
   freezes the image's packages. The Dockerfile installs with it unset, holding the image's own
   torch/CUDA stack with the constraints file of image_requirements.py instead, so pip never fails
   on it with an unexplained resolution error. Each constraint it would have enforced is checked
   here against what the install asks for; a conflict means the install replaces a package the
   image froze, and is named (package, constraint, file, the version asked for).
3. sglang's CUDA-side requirements (torch's siblings, nvidia-*, cuda-*, *-cuNN). Only the names
   in IMAGE_PROVIDED (image_requirements.py) are not installed from PyPI, for the reason given
   there; the image's version of each is checked against sglang's specifier. Every other
   nvidia-*/cuda-* requirement of sglang is installed at sglang's specifier, unless the image
   already has a version that satisfies it (then the constraints file holds it); a version that
   does not satisfy it is a conflict pip cannot resolve, named here first.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata as md
import os
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import Version

from image_requirements import IMAGE_PROVIDED, norm

# torch's siblings that sglang imports at module level only in its multimodal processors and
# audio/vision models (e.g. sglang/srt/models/midashenglm.py, srt/multimodal/processors/): the
# project's text-only Qwen2 path does not load them, so a mismatch is reported, not fatal.
NOT_ON_THE_TEXT_PATH = ("torchvision", "torchaudio")
CUDA_SIDE = re.compile(r"^(nvidia-|cuda-)|-cu\d+$")


def sglang_requirements() -> list[Requirement]:
    """sglang's requirements that apply on this platform with no extra (its installed metadata)."""
    reqs = [Requirement(r) for r in md.requires("sglang") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def cuda_majors(reqs: list[Requirement]) -> set[int]:
    """The CUDA majors sglang's wheels are built for, from `cuNN` in requirement names and extras."""
    tags = [n for r in reqs for n in [r.name, *r.extras]]
    return {int(m.group(1)) for t in tags if (m := re.search(r"(?:^|[-_])cu(\d{2})$", t.lower()))}


def installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def torch_cuda() -> str | None:
    """torch.version.cuda of the installed torch, read from torch/version.py without importing torch."""
    text = Path(md.distribution("torch").locate_file("torch/version.py")).read_text()
    for node in ast.parse(text).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "cuda":
            return ast.literal_eval(node.value)
    return None


def project_pins(pyproject: Path) -> dict[str, str]:
    """{name: version} of the exact pins in pyproject's dependencies and its gpu extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    pins = {}
    for spec in project["dependencies"] + project.get("optional-dependencies", {}).get("gpu", []):
        req = Requirement(spec)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pins[norm(req.name)] = exact[0]
    return pins


def check_torch(pins: dict[str, str], pyproject: Path, majors: set[int], problems: list[str]) -> None:
    want = pins.get("torch")
    have = installed("torch")
    if want is None:
        problems.append(f"{pyproject}: no exact torch pin (torch==X) to check the image against")
        return
    if have is None:
        problems.append(f"the image has no torch; {pyproject} pins torch=={want}")
        return
    cuda = torch_cuda()
    print(f"check_image: image torch {have} (CUDA {cuda}); {pyproject.name} pins torch=={want}; "
          f"sglang's wheels are built for CUDA {', '.join(map(str, sorted(majors))) or '(none declared)'}")
    if Version(have).public != str(Version(want)):
        problems.append(f"the image's torch is {have}, {pyproject} pins torch=={want}: sglang-kernel, flashinfer and "
                        f"sgl-deep-gemm are built against the released torch {want}; use a base image whose torch is "
                        f"exactly {want} (BASE build argument)")
    if majors and (cuda is None or int(cuda.split(".")[0]) not in majors):
        problems.append(f"the image's torch is built for CUDA {cuda}, sglang {installed('sglang')}'s wheels for CUDA "
                        f"{' or '.join(map(str, sorted(majors)))} (the cuNN in its requirements)")


def check_sglang_cuda_side(reqs: list[Requirement], problems: list[str], notices: list[str]) -> None:
    for req in reqs:
        name = norm(req.name)
        if name not in IMAGE_PROVIDED and not CUDA_SIDE.search(name):
            continue
        have = installed(req.name)
        ok = have is not None and req.specifier.contains(have, prereleases=True)
        if name in IMAGE_PROVIDED:
            line = f"{name}: not installed from PyPI ({IMAGE_PROVIDED[name]}); image has {have or 'none'}, sglang requires {req.specifier or 'any'}"
            if ok:
                print(f"check_image: {line}: ok")
            elif name in NOT_ON_THE_TEXT_PATH:
                notices.append(line + " (not loaded on the project's text-only path)")
            elif name != "torch":  # torch is checked exactly against the pin above
                problems.append(line)
        elif have is None:
            print(f"check_image: {name}: installed from PyPI at sglang's {req.specifier or 'any version'}")
        elif ok:
            print(f"check_image: {name}: the image's {have} satisfies sglang's {req.specifier or 'any'}; kept")
        else:
            problems.append(f"{name}: the image has {have}, sglang {installed('sglang')} requires {req.specifier}; "
                            f"the install holds the image's version, so pip could not satisfy sglang")


def constraint_files() -> list[Path]:
    # pip reads PIP_CONSTRAINT as a whitespace-separated list of files.
    return [Path(p) for p in os.environ.get("PIP_CONSTRAINT", "").split()]


def check_constraints(asked: dict[str, Requirement], problems: list[str], notices: list[str]) -> None:
    """Each constraint of PIP_CONSTRAINT's files against the requirement the install asks for."""
    files = constraint_files()
    if not files:
        print("check_image: PIP_CONSTRAINT is not set")
        return
    for path in files:
        if not path.is_file():
            problems.append(f"PIP_CONSTRAINT names {path}, which is not a file")
            continue
        for number, raw in enumerate(path.read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                con = Requirement(line)
            except InvalidRequirement:
                notices.append(f"{path}:{number}: {line!r} is not a requirement; not checked")
                continue
            name = norm(con.name)
            req = asked.get(name)
            if req is None or name in IMAGE_PROVIDED:
                continue  # not asked for by the install, or kept from the image (checked above)
            exact = [s.version for s in req.specifier if s.operator == "=="]
            con_exact = [s.version for s in con.specifier if s.operator == "=="]
            clash = (exact and not con.specifier.contains(exact[0], prereleases=True)) or \
                    (not exact and con_exact and not req.specifier.contains(con_exact[0], prereleases=True))
            if clash:
                problems.append(f"{name}: {path}:{number} constrains it to {con.specifier}, the install asks for "
                                f"{req.specifier}; the install runs with PIP_CONSTRAINT unset and replaces the "
                                f"image's frozen {name}")
    print(f"check_image: PIP_CONSTRAINT ({' '.join(map(str, files))}) checked; the install runs with it unset")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parents[1] / "pyproject.toml")
    args = ap.parse_args(argv)
    if installed("sglang") is None:
        print("check_image: sglang's metadata is not installed; run `pip install --no-deps sglang==<pin>` first",
              file=sys.stderr)
        return 1
    pins = project_pins(args.pyproject)
    reqs = sglang_requirements()
    problems: list[str] = []
    notices: list[str] = []
    check_torch(pins, args.pyproject, cuda_majors(reqs), problems)
    check_sglang_cuda_side(reqs, problems, notices)
    asked = {norm(r.name): r for r in reqs}
    asked.update({n: Requirement(f"{n}=={v}") for n, v in pins.items()})
    check_constraints(asked, problems, notices)
    for n in notices:
        print(f"check_image: note: {n}")
    if problems:
        print("check_image: the base image does not fit the project's pins:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print("check_image: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
