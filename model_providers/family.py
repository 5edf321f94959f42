"""A model family: the HF architectures it reads, its name table, and what megatron must know.

Pure Python (no torch): vapo-train checks a model's config.json against its family before torch
and megatron-core are imported. vapo_megatron/mcore/models.py turns an `Architecture` into
megatron's TransformerConfig and GPTModel, adding the parallel layout, dtype and fusions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from model_providers.table import Row


class HFConfigError(ValueError):
    """A Hugging Face config.json that cannot be used; the message names the file and the value."""


def source(hf_cfg: dict) -> str:
    """Where a config dict came from (registry.read_hf_config records the path under `_source`)."""
    return hf_cfg["_source"] if "_source" in hf_cfg else "config.json"


@dataclass(frozen=True)
class Architecture:
    """What megatron-core needs to know about one HF config.

    transformer: TransformerConfig fields that describe the architecture (sizes, norms, biases,
        attention); `activation_func` is given by name ("silu") and resolved in mcore/models.py.
    """

    transformer: dict
    rotary_base: float
    tied_embeddings: bool
    max_position_embeddings: int


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # HF `architectures` entries this family reads
    model_types: tuple[str, ...]  # HF `model_type` values (used when `architectures` is absent)
    rows: tuple[Row, ...]  # the actor's table (untied: lm_head <-> output_layer)
    critic_rows: tuple[Row, ...]  # added for the critic; the critic has no output_layer
    causal_lm_architecture: str  # written into an exported actor's config.json
    token_classification_architecture: str  # written into an exported critic's config.json
    # hf_cfg -> Architecture; raises HFConfigError naming the config and the value it cannot express.
    architecture: Callable[[dict], Architecture]

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


def rope_theta(hf_cfg: dict) -> float:
    """The RoPE base. Configs on the Hub carry `rope_theta`; transformers 5 writes `rope_parameters`.
    Only the default RoPE is expressed (no scaling)."""
    params = hf_cfg["rope_parameters"] if "rope_parameters" in hf_cfg else None
    scaling = hf_cfg["rope_scaling"] if "rope_scaling" in hf_cfg else None
    for key, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = spec["rope_type"] if spec and "rope_type" in spec else (spec["type"] if spec and "type" in spec else "default")
        if kind != "default":
            raise HFConfigError(f"{source(hf_cfg)}: {key}={spec} is not supported (only the default RoPE, without scaling)")
    if params and "rope_theta" in params:
        return float(params["rope_theta"])
    if "rope_theta" in hf_cfg:
        return float(hf_cfg["rope_theta"])
    raise HFConfigError(f"{source(hf_cfg)}: has neither rope_theta nor rope_parameters.rope_theta")


__all__ = ["Architecture", "Family", "HFConfigError", "rope_theta", "source", "tied_embeddings"]
