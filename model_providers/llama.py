"""Llama 3.x (LlamaForCausalLM; LlamaForTokenClassification for the critic): the name table and
the architecture megatron builds.

Llama: RMSNorm, SwiGLU MLP, GQA attention, no biases anywhere (attention_bias and mlp_bias false;
a config that sets either is refused), RoPE with theta 500000 and, from Llama 3.1 on, the
`llama3` RoPE scaling; tied embeddings for Llama 3.2 1B/3B; head_dim from the config when stated.

RoPE scaling. megatron-core 0.19.2's RotaryEmbedding (models/common/embeddings/
rotary_pos_embedding.py) applies Llama 3.1's frequency scaling when GPTModel gets
rope_scaling=True, with `rope_scaling_factor` as the factor; `_apply_scaling`'s other parameters
keep their defaults, which GPTModel cannot change: low_freq_factor=1, high_freq_factor=4,
original_max_position_embeddings=8192 (the published Llama 3.1/3.2/3.3 values). So the factor is
mapped and every other value of those three is refused, as is any other rope_type (linear,
dynamic, yarn, longrope, ...) and any key the llama3 scaling does not have. Pure Python: no torch.
"""

from __future__ import annotations

from model_providers.family import (
    Architecture,
    Family,
    HFConfigError,
    decoder_transformer,
    rope_scaling,
    rope_theta,
    source,
    tied_embeddings,
)
from model_providers.table import CRITIC_ROWS, Row

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."

ROWS = (
    Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Row(L + "input_layernorm.weight", (H + "input_layernorm.weight",), "copy"),
    Row(L + "self_attention.linear_qkv.weight",
        (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight", H + "self_attn.v_proj.weight"), "qkv"),
    Row(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",), "copy"),
    Row(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",), "copy"),
    Row(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "gate_up"),
    Row(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), "copy"),
    Row("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
    Row("output_layer.weight", ("lm_head.weight",), "vocab"),
)

# The values megatron-core's RotaryEmbedding._apply_scaling fixes (its keyword defaults; GPTModel
# passes only the factor). A llama3 rope_scaling must state exactly these.
MCORE_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Keys a llama3 RoPE dict may hold (transformers 5 also moves rope_theta into rope_parameters).
LLAMA3_KEYS = {"rope_type", "type", "rope_theta", "factor", *MCORE_LLAMA3_FIXED}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def llama3_factor(hf_cfg: dict) -> float | None:
    """The llama3 RoPE scaling factor of a config (None without scaling); HFConfigError naming the
    config.json and the value for anything megatron-core cannot express."""
    found = rope_scaling(hf_cfg)
    if found is None:
        return None
    key, spec = found  # rope_theta(..., scaled=("llama3",)) has refused every other rope_type
    src = source(hf_cfg)
    extra = sorted(set(spec) - LLAMA3_KEYS)
    if extra:
        raise HFConfigError(f"{src}: {key}.{extra[0]}={spec[extra[0]]!r} is not supported "
                            "(megatron-core's llama3 RoPE scaling takes only "
                            f"{', '.join(sorted(LLAMA3_KEYS - {'type'}))})")
    for name, fixed in MCORE_LLAMA3_FIXED.items():
        if name not in spec or not _number(spec[name]) or spec[name] != fixed:
            got = spec[name] if name in spec else "(absent)"
            raise HFConfigError(f"{src}: {key}.{name}={got!r} is not supported (megatron-core's llama3 RoPE scaling "
                                f"fixes {name}={fixed:g})")
    factor = spec["factor"] if "factor" in spec else None
    if not _number(factor) or factor <= 0:
        raise HFConfigError(f"{src}: {key}.factor={factor!r} is not supported (a positive number is needed)")
    return float(factor)


def _flag(hf_cfg: dict, key: str) -> bool:
    return bool(hf_cfg[key]) if key in hf_cfg else False


def _llama(hf_cfg: dict) -> Architecture:
    src = source(hf_cfg)
    for key in ("attention_bias", "mlp_bias"):
        if _flag(hf_cfg, key):
            raise HFConfigError(f"{src}: {key}={hf_cfg[key]!r} is not supported for Llama (only false: no biases)")
    theta = rope_theta(hf_cfg, scaled=("llama3",))
    return Architecture(
        transformer=decoder_transformer(hf_cfg, qkv_bias=False, qk_norm=False),
        rotary_base=theta,
        tied_embeddings=tied_embeddings(hf_cfg),
        max_position_embeddings=hf_cfg["max_position_embeddings"],
        rope_scaling_factor=llama3_factor(hf_cfg),
    )


LLAMA = Family(
    name="llama",
    architectures=("LlamaForCausalLM", "LlamaForTokenClassification"),
    model_types=("llama",),
    rows=ROWS,
    critic_rows=CRITIC_ROWS,
    causal_lm_architecture="LlamaForCausalLM",
    token_classification_architecture="LlamaForTokenClassification",
    architecture=_llama,
)

__all__ = ["LLAMA", "LLAMA3_KEYS", "MCORE_LLAMA3_FIXED", "llama3_factor"]
