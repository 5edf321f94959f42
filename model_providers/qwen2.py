"""Qwen2 / Qwen2.5 (and Qwen3 dense) on megatron-core: config translation and the weight table.

Qwen2: RMSNorm, SwiGLU MLP without biases, GQA attention with q/k/v biases and no o_proj bias,
RoPE. Qwen3 dense: the same without q/k/v biases, plus RMSNorm on each head's q and k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_providers.family import Family, tied_embeddings
from model_providers.mapping import Row, head_dim

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."


def _rows(qkv_bias: bool, qk_norm: bool) -> tuple[Row, ...]:
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
        Row(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "gate_up"),
        Row(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), "copy"),
        Row("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
        Row("output_layer.weight", ("lm_head.weight",), "vocab"),
    ]
    return tuple(rows)


# The critic's scalar value head <-> Qwen2ForTokenClassification(num_labels=1).score
CRITIC_ROWS = (
    Row("value_head.weight", ("score.weight",), "copy"),
    Row("value_head.bias", ("score.bias",), "copy"),
)


def rope_theta(hf_cfg: dict) -> float:
    """Qwen configs on the Hub carry `rope_theta`; transformers 5 writes `rope_parameters`."""
    params = hf_cfg["rope_parameters"] if "rope_parameters" in hf_cfg else None
    scaling = hf_cfg["rope_scaling"] if "rope_scaling" in hf_cfg else None
    for spec in (params, scaling):
        kind = spec["rope_type"] if spec and "rope_type" in spec else (spec["type"] if spec and "type" in spec else "default")
        if kind != "default":
            raise ValueError(f"RoPE scaling {spec} is not supported (only the default RoPE)")
    if params and "rope_theta" in params:
        return float(params["rope_theta"])
    if "rope_theta" in hf_cfg:
        return float(hf_cfg["rope_theta"])
    raise ValueError("config has neither rope_theta nor rope_parameters.rope_theta")


def _te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install
        return False
    return True


def layer_spec(config, vp_stage: int | None = None):
    """Transformer Engine's spec on the GPU when it imports, megatron's local spec otherwise (a
    CPU-initialized model, e.g. tests or vapo-plan's meta-device shards, never gets TE modules).
    The local spec with sequence parallelism is a block spec with norms that support it
    (sp_norm.py); TE's norms support it themselves."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from model_providers.sp_norm import local_block_spec

    if not config.use_cpu_initialization and _te_available():
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    if config.sequence_parallel:
        return local_block_spec(spec, get_num_layers_to_build(config, vp_stage=vp_stage))
    return spec


def _transformer_config(hf_cfg: dict, *, tp: int, pp: int, vpp: int | None, params_dtype: torch.dtype,
                        on_gpu: bool, recompute: bool, qkv_bias: bool, qk_layernorm: bool,
                        sequence_parallel: bool = False):
    from megatron.core.transformer import TransformerConfig

    if hf_cfg["hidden_act"] != "silu":
        raise ValueError(f"config.json hidden_act={hf_cfg['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    if "use_sliding_window" in hf_cfg and hf_cfg["use_sliding_window"]:
        raise ValueError("config.json use_sliding_window=true is not supported")
    for key, n in (("num_attention_heads", hf_cfg["num_attention_heads"]),
                   ("num_key_value_heads", hf_cfg["num_key_value_heads"])):
        if n % tp != 0:
            raise ValueError(f"tensor parallel size {tp} does not divide the model's {key}={n}")
    if hf_cfg["num_hidden_layers"] % (pp * (vpp or 1)) != 0:
        raise ValueError(f"num_hidden_layers={hf_cfg['num_hidden_layers']} is not divisible by "
                         f"pipeline parallel {pp} x virtual stages {vpp or 1}")
    te = on_gpu and _te_available()
    return TransformerConfig(
        num_layers=hf_cfg["num_hidden_layers"],
        hidden_size=hf_cfg["hidden_size"],
        ffn_hidden_size=hf_cfg["intermediate_size"],
        num_attention_heads=hf_cfg["num_attention_heads"],
        num_query_groups=hf_cfg["num_key_value_heads"],
        kv_channels=head_dim(hf_cfg),
        layernorm_epsilon=hf_cfg["rms_norm_eps"],
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        qk_layernorm=qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=hf_cfg["attention_dropout"],
        init_method_std=hf_cfg["initializer_range"],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        # Sequence parallelism shards the norm/dropout/residual activations [T, h] over TP along T;
        # it has nothing to shard without TP (megatron refuses it there, Megatron-LM turns it off).
        sequence_parallel=sequence_parallel and tp > 1,
        virtual_pipeline_model_parallel_size=vpp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # CPU: every fused kernel off (they are CUDA-only). GPU: megatron's fused bias-SwiGLU and
        # bias-dropout-add; RoPE fusion and wgrad accumulation fusion need Transformer Engine.
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        apply_rope_fusion=te,
        gradient_accumulation_fusion=te,
        persist_layer_norm=False,
        # Full activation recomputation: each layer keeps only its input for the backward pass
        # and recomputes the rest (a 32B model's activations at ~20k tokens per micro-batch do not
        # fit otherwise; vapo-plan estimates both ways).
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )


def _qwen2_config(hf_cfg, *, tp, pp, vpp, params_dtype, on_gpu, recompute=False, sequence_parallel=False):
    return _transformer_config(hf_cfg, tp=tp, pp=pp, vpp=vpp, params_dtype=params_dtype, on_gpu=on_gpu, recompute=recompute,
                               qkv_bias=True, qk_layernorm=False, sequence_parallel=sequence_parallel)


def _qwen3_config(hf_cfg, *, tp, pp, vpp, params_dtype, on_gpu, recompute=False, sequence_parallel=False):
    if hf_cfg["attention_bias"]:
        raise ValueError("Qwen3 config.json attention_bias=true is not supported")
    return _transformer_config(hf_cfg, tp=tp, pp=pp, vpp=vpp, params_dtype=params_dtype, on_gpu=on_gpu, recompute=recompute,
                               qkv_bias=False, qk_layernorm=True, sequence_parallel=sequence_parallel)


QWEN2 = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM", "Qwen2ForTokenClassification"),
    model_types=("qwen2",),
    rows=_rows(qkv_bias=True, qk_norm=False),
    critic_rows=CRITIC_ROWS,
    causal_lm_architecture="Qwen2ForCausalLM",
    token_classification_architecture="Qwen2ForTokenClassification",
    transformer_config=_qwen2_config,
)

QWEN3 = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM", "Qwen3ForTokenClassification"),
    model_types=("qwen3",),
    rows=_rows(qkv_bias=False, qk_norm=True),
    critic_rows=CRITIC_ROWS,
    causal_lm_architecture="Qwen3ForCausalLM",
    token_classification_architecture="Qwen3ForTokenClassification",
    transformer_config=_qwen3_config,
)

__all__ = ["QWEN2", "QWEN3", "rope_theta", "layer_spec", "tied_embeddings"]
