"""Parameter dtypes by name: the config's `model.dtype`, vapo-convert's --dtype, a checkpoint's vapo.json."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(hf_cfg: dict) -> str:
    """The dtype an HF config.json declares (transformers 5 writes "dtype", older files
    "torch_dtype"); float32 when it declares none."""
    for key in ("dtype", "torch_dtype"):
        if key in hf_cfg and hf_cfg[key] is not None:
            return str(hf_cfg[key]).removeprefix("torch.")
    return "float32"


__all__ = ["DTYPES", "dtype_name", "torch_dtype"]
