"""The families this project trains, and the one reader of a model's config.json.

    read_hf_config(hf_dir) -> dict     config.json, checked; its path under "_source"
    family_for(hf_cfg) -> Family       by `architectures` (else `model_type`)

Every command reads model configs through read_hf_config (the trainer, its start-up checks,
vapo-convert, vapo-eval, vapo-plan), so a bad file gives the same one-line error everywhere.
Pure Python: no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from model_providers.family import Family, HFConfigError, source
from model_providers.llama import LLAMA
from model_providers.qwen2 import QWEN2, QWEN3
from model_providers.qwen3_moe import QWEN3_MOE

FAMILIES: tuple[Family, ...] = (QWEN2, QWEN3, QWEN3_MOE, LLAMA)

# Positive integers every family needs (sizes of the model and of its layout checks).
REQUIRED_SIZES = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size", "intermediate_size")


def read_hf_config(hf_dir: str | Path) -> dict:
    """The config.json of an HF model directory as a dict, with `_source` = its path.

    Raises HFConfigError naming the directory or file: not a directory, no config.json,
    unreadable JSON, not an object, or a size that is not a positive integer."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise HFConfigError(f"{hf_dir} is not a directory (expected a Hugging Face model directory)")
    path = hf_dir / "config.json"
    if not path.is_file():
        raise HFConfigError(f"{hf_dir} has no config.json")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFConfigError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{path} must hold a JSON object")
    bad = [k for k in REQUIRED_SIZES
           if k not in cfg or not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1]
    if bad:
        raise HFConfigError(f"{path} lacks positive integer {', '.join(bad)}")
    cfg["_source"] = str(path)
    return cfg


def family_for(hf_cfg: dict) -> Family:
    """The family of an HF config, by `architectures` (else `model_type`); HFConfigError naming
    the config and the supported architectures otherwise."""
    archs = hf_cfg["architectures"] if "architectures" in hf_cfg and hf_cfg["architectures"] else None
    for fam in FAMILIES:
        if archs and any(a in fam.architectures for a in archs):
            return fam
        if not archs and "model_type" in hf_cfg and hf_cfg["model_type"] in fam.model_types:
            return fam
    supported = sorted(a for fam in FAMILIES for a in fam.architectures)
    what = (f"architectures={archs}" if archs
            else f"model_type={hf_cfg['model_type'] if 'model_type' in hf_cfg else None!r}")
    raise HFConfigError(f"{source(hf_cfg)}: unsupported architecture ({what}); "
                        f"supported architectures: {', '.join(supported)}")


def check_supported(hf_cfg: dict) -> Family:
    """family_for, then the family's own checks of what megatron can express (HFConfigError)."""
    family = family_for(hf_cfg)
    family.architecture(hf_cfg)
    return family


def clean(hf_cfg: dict) -> dict:
    """The config as HF wrote it (without the `_source` bookkeeping), for writing back out."""
    return {k: v for k, v in hf_cfg.items() if k != "_source"}


__all__ = ["FAMILIES", "HFConfigError", "check_supported", "clean", "family_for", "read_hf_config"]
