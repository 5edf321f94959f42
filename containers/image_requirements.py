"""Requirements for containers/Dockerfile: what the project and sglang need beyond an NGC image.

Writes two pip files:
- requirements: every dependency of vapo-megatron and sglang (their metadata, as installed with
  --no-deps), except the packages named in IMAGE_PROVIDED, each for the reason given there;
  sglang's other nvidia-*/cuda-* requirements are kept (installed at sglang's specifier unless the
  image already satisfies it);
- constraints: the image's own versions of IMAGE_PROVIDED and of every nvidia-*/cuda-* package it
  has, so that no dependency pulls another build of them.
containers/check_image.py runs first and checks the image's torch (exact version and CUDA major),
PIP_CONSTRAINT and sglang's CUDA-side requirements against the pins.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

# Taken from the image, never installed from PyPI: a PyPI build would replace the image's torch
# stack, which its Transformer Engine and Apex are compiled against. The image's versions are
# checked by check_image.py (torch exactly against the pin, the others against sglang's specifiers).
_TORCH = "the image's torch build; its Transformer Engine and Apex are compiled against it"
_SIBLING = "built against the image's torch; a PyPI build would pull PyPI's torch"
_TE = "Transformer Engine, compiled in the image against its torch and CUDA"
IMAGE_PROVIDED = {
    "torch": _TORCH,
    "torchvision": _SIBLING,
    "torchaudio": _SIBLING,
    "triton": "the Triton release the image's torch was built and tested with",
    "transformer-engine": _TE,
    "transformer-engine-torch": _TE,
    "transformer-engine-cu12": _TE,
    "transformer-engine-cu13": _TE,
    "apex": "NVIDIA Apex, compiled in the image (not on PyPI; the PyPI 'apex' is unrelated)",
}
# The image's own CUDA-side wheels, held at its versions by the constraints file.
IMAGE_PREFIXES = ("nvidia-", "cuda-")


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def held_at_image_version(name: str) -> bool:
    n = norm(name)
    return n in IMAGE_PROVIDED or n.startswith(IMAGE_PREFIXES)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requirements", required=True)
    ap.add_argument("--constraints", required=True)
    args = ap.parse_args()

    reqs = []
    for dist in ("vapo-megatron", "sglang"):
        for spec in md.requires(dist) or []:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if norm(req.name) not in IMAGE_PROVIDED:
                reqs.append(str(req))
    constraints = [f"{d.metadata['Name']}=={d.version}" for d in md.distributions() if held_at_image_version(d.metadata["Name"])]
    with open(args.requirements, "w") as f:
        f.write("\n".join(sorted(set(reqs))) + "\n")
    with open(args.constraints, "w") as f:
        f.write("\n".join(sorted(set(constraints))) + "\n")
    print(f"image_requirements: {len(set(reqs))} requirements, {len(set(constraints))} image packages held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
