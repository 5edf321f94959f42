"""Qwen2 / Qwen2.5 and Qwen3 dense: the name tables and the architecture megatron builds.

Qwen2: RMSNorm, SwiGLU MLP without biases, GQA attention with q/k/v biases and no o_proj bias,
RoPE. Qwen3 dense: the same without q/k/v biases, plus RMSNorm on each head's q and k, and a
head_dim that the config states (it may differ from hidden/heads). Pure Python: no torch here.
"""

from __future__ import annotations

from model_providers.family import (
    Architecture,
    Family,
    HFConfigError,
    decoder_transformer,
    rope_theta,
    source,
    tied_embeddings,
)
from model_providers.table import CRITIC_ROWS, Row

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."


def attention_rows(qkv_bias: bool, qk_norm: bool) -> list[Row]:
    """Embedding, input norm and attention rows (shared with Qwen3-MoE, qwen3_moe.py)."""
    rows = [
        Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
        Row(L + "input_layernorm.weight", (H + "input_layernorm.weight",), "copy"),
        Row(L + "self_attention.linear_qkv.weight",
            (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight", H + "self_attn.v_proj.weight"), "qkv"),
    ]
    if qkv_bias:
        rows.append(Row(L + "self_attention.linear_qkv.bias",
                        (H + "self_attn.q_proj.bias", H + "self_attn.k_proj.bias", H + "self_attn.v_proj.bias"), "qkv"))
    if qk_norm:
        rows += [
            Row(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",), "copy"),
            Row(L + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",), "copy"),
        ]
    rows += [
        Row(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",), "copy"),
        Row(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",), "copy"),
    ]
    return rows


# A dense SwiGLU MLP, and the final norm and LM head.
MLP_ROWS = (
    Row(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "gate_up"),
    Row(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), "copy"),
)
HEAD_ROWS = (
    Row("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
    Row("output_layer.weight", ("lm_head.weight",), "vocab"),
)


def _rows(qkv_bias: bool, qk_norm: bool) -> tuple[Row, ...]:
    return (*attention_rows(qkv_bias, qk_norm), *MLP_ROWS, *HEAD_ROWS)


def _architecture(hf_cfg: dict, *, qkv_bias: bool, qk_norm: bool) -> Architecture:
    if "use_sliding_window" in hf_cfg and hf_cfg["use_sliding_window"]:
        raise HFConfigError(f"{source(hf_cfg)}: use_sliding_window=true is not supported")
    return Architecture(
        transformer=decoder_transformer(hf_cfg, qkv_bias=qkv_bias, qk_norm=qk_norm),
        rotary_base=rope_theta(hf_cfg),
        tied_embeddings=tied_embeddings(hf_cfg),
        max_position_embeddings=hf_cfg["max_position_embeddings"],
    )


def _qwen2(hf_cfg: dict) -> Architecture:
    return _architecture(hf_cfg, qkv_bias=True, qk_norm=False)


def _qwen3(hf_cfg: dict) -> Architecture:
    if "attention_bias" in hf_cfg and hf_cfg["attention_bias"]:
        raise HFConfigError(f"{source(hf_cfg)}: attention_bias=true is not supported for Qwen3")
    return _architecture(hf_cfg, qkv_bias=False, qk_norm=True)


QWEN2 = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM", "Qwen2ForTokenClassification"),
    model_types=("qwen2",),
    rows=_rows(qkv_bias=True, qk_norm=False),
    critic_rows=CRITIC_ROWS,
    causal_lm_architecture="Qwen2ForCausalLM",
    token_classification_architecture="Qwen2ForTokenClassification",
    architecture=_qwen2,
)

QWEN3 = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM", "Qwen3ForTokenClassification"),
    model_types=("qwen3",),
    rows=_rows(qkv_bias=False, qk_norm=True),
    critic_rows=CRITIC_ROWS,
    causal_lm_architecture="Qwen3ForCausalLM",
    token_classification_architecture="Qwen3ForTokenClassification",
    architecture=_qwen3,
)

__all__ = ["HEAD_ROWS", "MLP_ROWS", "QWEN2", "QWEN3", "attention_rows"]
