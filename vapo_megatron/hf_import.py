"""Load HF safetensors into Megatron model chunks: stream only the tensors this rank needs,
convert them with the family's table, and copy this rank's TP shard into each parameter."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from model_providers.family import Family
from model_providers.mapping import hf_to_mcore, shard
from vapo_megatron.hf_export import _tp, _unwrap, param_rows


def weight_map(hf_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            return {k: hf_dir / v for k, v in json.load(f)["weight_map"].items()}
    single = hf_dir / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"{hf_dir}: neither model.safetensors.index.json nor model.safetensors found")


def load_hf_weights(model_chunks: list, family: Family, hf_cfg: dict, hf_dir: str | Path, *, critic: bool = False) -> list[str]:
    """Fill every parameter of `model_chunks` from the HF checkpoint in `hf_dir`.

    Returns the names of parameters left as initialized: only the critic's value head, when the
    checkpoint is a causal LM without a `score` head (a fresh critic from the policy)."""
    from megatron.core import parallel_state

    names = weight_map(hf_dir)
    _, tp = _tp()
    rank = parallel_state.get_tensor_model_parallel_rank()
    table = family.table(hf_cfg, critic=critic)
    critic_only = {r.mcore for r in family.critic_rows}
    handles: dict[Path, object] = {}
    left = []

    def read(name: str) -> torch.Tensor:
        path = names[name]
        if path not in handles:
            handles[path] = safe_open(path, framework="pt")
        return handles[path].get_tensor(name)

    with torch.no_grad():
        for chunk in model_chunks:
            for param, row, layer, local_name in param_rows(chunk, table):
                hf_names = row.hf_names(layer)
                missing = [n for n in hf_names if n not in names]
                if missing and row.mcore in critic_only:
                    left.append(local_name)
                    continue
                if missing:
                    raise KeyError(f"{hf_dir}: tensor(s) {missing} needed for {local_name} are not in the checkpoint")
                padded = param.shape[0] * tp if row.layout == "vocab" else None
                full = hf_to_mcore(row, [read(n) for n in hf_names], hf_cfg, padded_vocab=padded)
                if getattr(param, "tensor_model_parallel", False) and tp > 1:
                    full = shard(row.layout, full, param.partition_dim, tp, rank)
                if full.shape != param.shape:
                    raise ValueError(f"{hf_dir}: {hf_names} give shape {tuple(full.shape)} for {local_name}, "
                                     f"which has shape {tuple(param.shape)}")
                param.copy_(full.to(param.dtype))
    return left


__all__ = ["load_hf_weights", "weight_map", "_unwrap"]
