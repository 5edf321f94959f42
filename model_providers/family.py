"""A model family: what turns an HF config into a Megatron model, and how weights map across."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from model_providers.mapping import Row


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # HF `architectures` entries this family reads
    model_types: tuple[str, ...]  # HF `model_type` values (used when `architectures` is absent)
    rows: tuple[Row, ...]  # the actor's table (untied: lm_head <-> output_layer)
    critic_rows: tuple[Row, ...]  # added for the critic; the critic has no output_layer
    causal_lm_architecture: str  # written into an exported actor's config.json
    token_classification_architecture: str  # written into an exported critic's config.json
    # transformer_config(hf_cfg, *, tp, pp, vpp, params_dtype, on_gpu, recompute=False,
    #                    sequence_parallel=False) -> TransformerConfig
    transformer_config: Callable[..., "object"]

    def table(self, hf_cfg: dict, *, critic: bool) -> tuple[Row, ...]:
        """Rows for import. Tied embeddings: the last stage's output_layer (a separate param when
        PP > 1) is loaded from embed_tokens; export skips it (see `export_table`)."""
        if critic:
            return tuple(r for r in self.rows if r.mcore != "output_layer.weight") + self.critic_rows
        if tied_embeddings(hf_cfg):
            return tuple(
                Row(r.mcore, ("model.embed_tokens.weight",), r.layout) if r.mcore == "output_layer.weight" else r
                for r in self.rows
            )
        return self.rows

    def export_table(self, hf_cfg: dict, *, critic: bool) -> tuple[Row, ...]:
        rows = self.table(hf_cfg, critic=critic)
        if tied_embeddings(hf_cfg):
            rows = tuple(r for r in rows if r.mcore != "output_layer.weight")
        return rows


def tied_embeddings(hf_cfg: dict) -> bool:
    # HF's PretrainedConfig default for tie_word_embeddings is True; Qwen2 configs state it.
    return bool(hf_cfg["tie_word_embeddings"]) if "tie_word_embeddings" in hf_cfg else True


def torch_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(table)}")
    return table[name]
