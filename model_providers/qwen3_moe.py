"""Qwen3-MoE (Qwen3MoeForCausalLM; Qwen3MoeForTokenClassification for the critic): the name table
and the architecture megatron builds.

Qwen3-MoE is Qwen3's attention (GQA without biases, RMSNorm on each head's q and k, head_dim from
the config) with the MLP of most layers replaced by routed experts:
- a router (HF `mlp.gate`, megatron `mlp.router`, [E, H], no bias) scores E experts per token;
  each token goes to its top-k (num_experts_per_tok);
- norm_topk_prob=true: the k chosen weights are renormalized to sum to 1, which is a softmax
  over the k chosen logits (megatron's moe_router_pre_softmax=False); false: they are the softmax
  over all E (moe_router_pre_softmax=True);
- each expert is a SwiGLU MLP of width moe_intermediate_size; there is no shared expert;
- layer i keeps a dense MLP (width intermediate_size) when i is in mlp_only_layers or
  (i + 1) % decoder_sparse_step != 0 (transformers' Qwen3MoeDecoderLayer rule), which is
  megatron's per-layer moe_layer_freq list.

On disk HF keeps one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...), which is what
SGLang's Qwen3MoeForCausalLM.load_weights and Hugging Face checkpoints use; transformers 5 fuses
them into 3D `mlp.experts.gate_up_proj` / `down_proj` parameters only in memory (the embedded
engine writes into slices of those, rollout/embedded.py). Megatron's local spec keeps one
SequentialMLP expert per module (`mlp.experts.local_experts.{k}`), numbered locally on each
expert-parallel rank; Transformer Engine's grouped GEMM names them `mlp.experts.linear_fc1.weight{k}`
(weights/params.py maps both). Pure Python: no torch.
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
from model_providers.qwen2 import HEAD_ROWS, MLP_ROWS, attention_rows
from model_providers.table import CRITIC_ROWS, Row

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."
X = "mlp.experts.{expert}."

EXPERT_ROWS = (
    Row(L + "mlp.router.weight", (H + "mlp.gate.weight",), "copy"),
    Row(L + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
        (H + X + "gate_proj.weight", H + X + "up_proj.weight"), "gate_up"),
    Row(L + "mlp.experts.local_experts.{expert}.linear_fc2.weight", (H + X + "down_proj.weight",), "copy"),
)

# Dense-MLP rows stay in the table for the layers that keep one (mlp_only_layers).
ROWS = (*attention_rows(qkv_bias=False, qk_norm=True), *MLP_ROWS, *EXPERT_ROWS, *HEAD_ROWS)


def num_experts(hf_cfg: dict) -> int:
    # Hub configs say num_experts; transformers 5 writes num_local_experts (its attribute_map).
    for key in ("num_experts", "num_local_experts"):
        if key in hf_cfg and hf_cfg[key] is not None:
            return hf_cfg[key]
    raise HFConfigError(f"{source(hf_cfg)}: has neither num_experts nor num_local_experts")


def moe_layer_pattern(hf_cfg: dict) -> list[int]:
    """1 for a layer with routed experts, 0 for a dense one (transformers' Qwen3MoeDecoderLayer)."""
    step = hf_cfg["decoder_sparse_step"] if "decoder_sparse_step" in hf_cfg else 1
    dense = set(hf_cfg["mlp_only_layers"] if "mlp_only_layers" in hf_cfg and hf_cfg["mlp_only_layers"] else [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(hf_cfg["num_hidden_layers"])]


def _positive(hf_cfg: dict, key: str) -> int:
    v = hf_cfg[key] if key in hf_cfg else None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise HFConfigError(f"{source(hf_cfg)}: {key}={v!r} is not supported (a positive integer is needed)")
    return v


def _qwen3_moe(hf_cfg: dict) -> Architecture:
    src = source(hf_cfg)
    if "attention_bias" in hf_cfg and hf_cfg["attention_bias"]:
        raise HFConfigError(f"{src}: attention_bias=true is not supported for Qwen3-MoE")
    if "use_sliding_window" in hf_cfg and hf_cfg["use_sliding_window"]:
        raise HFConfigError(f"{src}: use_sliding_window=true is not supported")
    experts = num_experts(hf_cfg)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        raise HFConfigError(f"{src}: num_experts={experts!r} is not supported (a positive integer is needed)")
    top_k, width = _positive(hf_cfg, "num_experts_per_tok"), _positive(hf_cfg, "moe_intermediate_size")
    if top_k > experts:
        raise HFConfigError(f"{src}: num_experts_per_tok={top_k} is more than num_experts={experts}")
    if "decoder_sparse_step" in hf_cfg:
        _positive(hf_cfg, "decoder_sparse_step")
    pattern = moe_layer_pattern(hf_cfg)
    if not any(pattern):
        raise HFConfigError(f"{src}: no layer has routed experts (mlp_only_layers / decoder_sparse_step)")
    norm_topk = bool(hf_cfg["norm_topk_prob"]) if "norm_topk_prob" in hf_cfg else False
    return Architecture(
        transformer=dict(
            decoder_transformer(hf_cfg, qkv_bias=False, qk_norm=True),
            num_moe_experts=experts,
            moe_ffn_hidden_size=width,
            moe_router_topk=top_k,
            moe_router_pre_softmax=not norm_topk,  # see the module docstring
            moe_layer_freq=pattern,
        ),
        rotary_base=rope_theta(hf_cfg),
        tied_embeddings=tied_embeddings(hf_cfg),
        max_position_embeddings=hf_cfg["max_position_embeddings"],
    )


QWEN3_MOE = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM", "Qwen3MoeForTokenClassification"),
    model_types=("qwen3_moe",),
    rows=ROWS,
    critic_rows=CRITIC_ROWS,
    causal_lm_architecture="Qwen3MoeForCausalLM",
    token_classification_architecture="Qwen3MoeForTokenClassification",
    architecture=_qwen3_moe,
)

__all__ = ["EXPERT_ROWS", "QWEN3_MOE", "moe_layer_pattern", "num_experts"]
