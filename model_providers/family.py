"""A model family: the HF architectures it reads, its name table, and what megatron must know.

Pure Python (no torch): vapo-train checks a model's config.json against its family before torch
and megatron-core are imported. vapo_megatron/mcore/models.py turns an `Architecture` into
megatron's TransformerConfig and GPTModel, adding the parallel layout, dtype and fusions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from model_providers.table import Row, head_dim, query_groups


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
    # Llama 3.1's RoPE scaling (megatron's GPTModel rope_scaling=True with this factor; its other
    # parameters are fixed in megatron, see llama.py); None: plain RoPE.
    rope_scaling_factor: float | None = None

    @property
    def num_experts(self) -> int | None:
        """Routed experts per MoE layer (None: a dense model)."""
        return self.transformer["num_moe_experts"] if "num_moe_experts" in self.transformer else None


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


def decoder_transformer(hf_cfg: dict, *, qkv_bias: bool, qk_norm: bool) -> dict:
    """The TransformerConfig fields of a pre-norm RMSNorm / SwiGLU / GQA / RoPE decoder, as Qwen2,
    Qwen3 (dense and MoE) and Llama all are; each family checks its own flags before calling this.
    attention_dropout and initializer_range take HF's PretrainedConfig defaults when absent."""
    act = hf_cfg["hidden_act"] if "hidden_act" in hf_cfg else "silu"
    if act != "silu":
        raise HFConfigError(f"{source(hf_cfg)}: hidden_act={act!r} is not supported (only 'silu', SwiGLU)")
    return dict(
        num_layers=hf_cfg["num_hidden_layers"],
        hidden_size=hf_cfg["hidden_size"],
        ffn_hidden_size=hf_cfg["intermediate_size"],
        num_attention_heads=hf_cfg["num_attention_heads"],
        num_query_groups=query_groups(hf_cfg),
        kv_channels=head_dim(hf_cfg),
        layernorm_epsilon=hf_cfg["rms_norm_eps"],
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func="silu",
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        qk_layernorm=qk_norm,
        hidden_dropout=0.0,
        attention_dropout=hf_cfg["attention_dropout"] if "attention_dropout" in hf_cfg else 0.0,
        init_method_std=hf_cfg["initializer_range"] if "initializer_range" in hf_cfg else 0.02,
    )


def tied_embeddings(hf_cfg: dict) -> bool:
    # HF's PretrainedConfig default for tie_word_embeddings is True; Qwen2 configs state it.
    return bool(hf_cfg["tie_word_embeddings"]) if "tie_word_embeddings" in hf_cfg else True


def rope_scaling(hf_cfg: dict) -> tuple[str, dict] | None:
    """The RoPE variant a config asks for beyond the default: (the key it is under, its dict), or
    None. Configs on the Hub carry `rope_scaling`; transformers 5 writes `rope_parameters`."""
    for key in ("rope_parameters", "rope_scaling"):
        spec = hf_cfg[key] if key in hf_cfg else None
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise HFConfigError(f"{source(hf_cfg)}: {key}={spec!r} is not supported (expected an object)")
        if rope_type(spec) != "default":
            return key, spec
    return None


def rope_type(spec: dict) -> str:
    # `rope_type`; older configs say `type`; absent means the default RoPE.
    return spec["rope_type"] if "rope_type" in spec else (spec["type"] if "type" in spec else "default")


def rope_theta(hf_cfg: dict, *, scaled: tuple[str, ...] = ()) -> float:
    """The RoPE base. A RoPE scaling whose type is not in `scaled` (the family reads those itself)
    is refused, naming the config and the value."""
    found = rope_scaling(hf_cfg)
    if found and rope_type(found[1]) not in scaled:
        key, spec = found
        only = (f"only {', '.join(repr(t) for t in scaled)} or the default RoPE" if scaled
                else "only the default RoPE, without scaling")
        raise HFConfigError(f"{source(hf_cfg)}: {key}={spec} is not supported ({only})")
    params = hf_cfg["rope_parameters"] if "rope_parameters" in hf_cfg else None
    if params and "rope_theta" in params:
        return float(params["rope_theta"])
    if "rope_theta" in hf_cfg:
        return float(hf_cfg["rope_theta"])
    raise HFConfigError(f"{source(hf_cfg)}: has neither rope_theta nor rope_parameters.rope_theta")


__all__ = ["Architecture", "Family", "HFConfigError", "decoder_transformer", "rope_scaling", "rope_theta", "rope_type",
           "source", "tied_embeddings"]
