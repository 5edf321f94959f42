"""Requirements for containers/Dockerfile: what the project and sglang need beyond an NGC image.

Writes two pip files:
- requirements: every dependency of vapo-megatron and sglang (their metadata, as installed with
  --no-deps), except the packages the image already provides (torch and its siblings,
  Transformer Engine, Apex, NCCL/CUDA wheels), which would otherwise be replaced by PyPI builds;
- constraints: the image's own versions of those packages, so that nothing pulls another one.
Stops with a clear message when the image's torch is not the project's pinned minor version.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.version import Version

# Provided by the NGC PyTorch image (built against its torch); never reinstalled from PyPI.
IMAGE_PROVIDED = ("torch", "torchvision", "torchaudio", "transformer-engine", "transformer-engine-torch",
                  "transformer-engine-cu12", "transformer-engine-cu13", "apex", "triton")
IMAGE_PREFIXES = ("nvidia-", "cuda-")


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def provided_by_image(name: str) -> bool:
    n = norm(name)
    return n in IMAGE_PROVIDED or n.startswith(IMAGE_PREFIXES)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requirements", required=True)
    ap.add_argument("--constraints", required=True)
    args = ap.parse_args()

    pinned_torch = next(Requirement(r) for r in md.requires("vapo-megatron") if norm(Requirement(r).name) == "torch")
    want = Version(next(iter(pinned_torch.specifier)).version)
    have = Version(md.version("torch"))
    if (have.major, have.minor) != (want.major, want.minor):
        print(f"image_requirements: the image's torch is {have}, the project pins {want}: use the NGC "
              f"release whose torch is {want.major}.{want.minor} (BASE build argument)", file=sys.stderr)
        return 1

    reqs = []
    for dist in ("vapo-megatron", "sglang"):
        for spec in md.requires(dist) or []:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if not provided_by_image(req.name):
                reqs.append(str(req))
    constraints = [f"{d.metadata['Name']}=={d.version}" for d in md.distributions() if provided_by_image(d.metadata["Name"])]
    with open(args.requirements, "w") as f:
        f.write("\n".join(sorted(set(reqs))) + "\n")
    with open(args.constraints, "w") as f:
        f.write("\n".join(sorted(set(constraints))) + "\n")
    print(f"image_requirements: {len(set(reqs))} requirements, {len(set(constraints))} image packages held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
