"""Model providers: HF config -> megatron-core model, and the HF <-> Megatron weight tables.

    family_for(hf_cfg) -> Family      which family reads this config (Qwen2, Qwen3 dense)
    load_hf_config(hf_dir) -> dict    the config.json of an HF model directory
Builders live in model_providers.build, named configs in model_providers.presets.
"""

from __future__ import annotations

import json
from pathlib import Path

from model_providers.family import Family
from model_providers.qwen2 import QWEN2, QWEN3

FAMILIES: tuple[Family, ...] = (QWEN2, QWEN3)


def family_for(hf_cfg: dict, *, source: str = "config.json") -> Family:
    """The family of an HF config, by `architectures` (else `model_type`).

    `source` names the config in the error (load_hf_config records its path under `_source`)."""
    if "_source" in hf_cfg:
        source = hf_cfg["_source"]
    archs = hf_cfg["architectures"] if "architectures" in hf_cfg and hf_cfg["architectures"] else None
    for fam in FAMILIES:
        if archs and any(a in fam.architectures for a in archs):
            return fam
        if not archs and "model_type" in hf_cfg and hf_cfg["model_type"] in fam.model_types:
            return fam
    supported = sorted(a for fam in FAMILIES for a in fam.architectures)
    what = f"architectures={archs}" if archs else f"model_type={hf_cfg['model_type'] if 'model_type' in hf_cfg else None!r}"
    raise ValueError(f"{source}: unsupported architecture ({what}); supported architectures: {', '.join(supported)}")


def load_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in the HF model directory {Path(hf_dir)} (looked for {path})")
    with open(path) as f:
        cfg = json.load(f)
    cfg["_source"] = str(path)
    return cfg


__all__ = ["Family", "FAMILIES", "QWEN2", "QWEN3", "family_for", "load_hf_config"]
