"""A model's shapes, parameter count and the FLOPs of one token, from its HF config: what the
step-time model (sizing/step_time.py) computes with. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shapes:
    """What the FLOPs and bytes need of an HF config (sizes as in config.json)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0
    expert_ffn: int = 0
    moe_layers: int = 0  # layers with routed experts; the others keep a dense MLP

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def attention_params(self) -> int:
        """q, k, v, o (+ q/k/v biases, + per-head q/k norms) and the layer's two RMSNorms."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return qkv + bias + self.heads * self.head_dim * self.hidden + norms + 2 * self.hidden

    def params(self, *, critic: bool = False) -> int:
        """Every parameter: the actor's LM head (unless tied), or the critic's value head [1, h] + bias."""
        dense_mlp = 3 * self.hidden * self.ffn
        moe_mlp = self.experts * 3 * self.hidden * self.expert_ffn + self.hidden * self.experts  # + router
        head = self.hidden + 1 if critic else (0 if self.tied else self.vocab * self.hidden)
        return (self.vocab * self.hidden + self.layers * self.attention_params() + self.dense_layers * dense_mlp
                + self.moe_layers * moe_mlp + self.hidden + head)

    def expert_params(self) -> int:
        """The routed experts' parameters (split over parallel.ep ranks)."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.expert_ffn

    def hf_tensors(self) -> int:
        """HF tensors of the actor, the weight sync's unit: per layer q, k, v, o, two norms (+ 3
        biases, + 2 q/k norms), gate, up, down per dense MLP or per expert (+ the router)."""
        per_layer = 6 + 3 * self.qkv_bias + 2 * self.qk_norm
        return (self.layers * per_layer + 3 * self.dense_layers + self.moe_layers * (3 * self.experts + 1)
                + 2 + (not self.tied))

    def kv_bytes_per_token(self, engine_tp: int) -> int:
        """SGLang's bf16 K and V of every layer, per GPU (KV heads replicated past their number),
        as rollout/engines.py sglang_kv_bytes_per_token."""
        return 2 * self.layers * max(1, self.kv_heads // engine_tp) * self.head_dim * 2


def shapes_from_hf(hf_cfg: dict) -> Shapes:
    """The shapes of a supported HF config (model_providers reads it as the trainer does)."""
    from model_providers import family_for
    from model_providers.family import tied_embeddings
    from model_providers.table import head_dim, query_groups

    t = family_for(hf_cfg).architecture(hf_cfg).transformer
    moe = {}
    if "num_moe_experts" in t:
        pattern = t["moe_layer_freq"]
        moe = dict(experts=t["num_moe_experts"], top_k=t["moe_router_topk"], expert_ffn=t["moe_ffn_hidden_size"],
                   moe_layers=sum(pattern) if isinstance(pattern, list) else hf_cfg["num_hidden_layers"])
    return Shapes(layers=hf_cfg["num_hidden_layers"], hidden=hf_cfg["hidden_size"], heads=hf_cfg["num_attention_heads"],
                  kv_heads=query_groups(hf_cfg), head_dim=head_dim(hf_cfg), ffn=hf_cfg["intermediate_size"],
                  vocab=hf_cfg["vocab_size"], tied=tied_embeddings(hf_cfg), qkv_bias=bool(t["add_qkv_bias"]),
                  qk_norm=bool(t["qk_layernorm"]), **moe)


def forward_flops_per_token(s: Shapes, *, context: float, lm_head: bool) -> float:
    """Matmul FLOPs of one token's forward pass: 2 per weight it meets (the k routed experts only
    in an MoE layer) + attention's QK^T and PV over `context` keys (4 a d per layer and key) +
    the LM head [h, V] (actor) or the value head [h, 1] (critic). Backward is 2x this."""
    linear = 2 * (s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden)  # q, k, v, o
    attention = 4 * s.heads * s.head_dim * context
    dense_mlp = 2 * 3 * s.hidden * s.ffn
    moe_mlp = 2 * 3 * s.hidden * s.expert_ffn * s.top_k + 2 * s.hidden * s.experts
    head = 2 * s.hidden * (s.vocab if lm_head else 1)
    return s.layers * (linear + attention) + s.dense_layers * dense_mlp + s.moe_layers * moe_mlp + head


__all__ = ["Shapes", "forward_flops_per_token", "shapes_from_hf"]
