"""Test double of transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py
`DotProductAttention` (TE 2.20, class at ~415): megatron's TEDotProductAttention, the TE spec's
core attention.

As TE has it:
- a TransformerEngineBaseModule (so its state_dict holds `_extra_state`, base.py) without
  parameters for softmax_type "vanilla";
- num_gqa_groups (default: num_attention_heads) must divide the heads; per rank the heads and
  groups are divided by the TP size; kv_channels an int or (k, v) head dims; softmax_scale
  defaults to 1/sqrt(k head dim) (~756); attn_mask_type "causal_padding" reads as
  "padding_causal" (~710);
- forward(query, key, value, attention_mask, qkv_format, attn_mask_type, ...) with "sbhd" /
  "bshd" tensors [s, b, h, d]: asserts equal dtypes, K/V shapes, head dims and this rank's GQA
  groups (~1700-1730); "causal" masks key j > query i (top-left: TE forces bottom_right_diagonal
  off for causal, ~1745), "causal_bottom_right" key j > i + (s_kv - s_q), "no_mask" none; returns
  [s, b, h * d_v] (sbhd) or [b, s, h * d_v].
The maths are plain softmax attention in float32 (as the flash/fused kernels accumulate), cast
back to the input dtype. Not modelled (NotImplementedError): attention dropout while training,
padding masks, "thd" packing, context parallelism, sliding windows, attention biases,
non-vanilla softmax, max-logit return, FP8.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule, distributed_world_size, refuse_unmodelled

MASKS = ("no_mask", "causal", "causal_bottom_right")


class DotProductAttention(TransformerEngineBaseModule):
    def __init__(self, num_attention_heads: int, kv_channels, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size=None, bottom_right_diagonal=None, sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker=None, tp_group=None, layer_number: Optional[int] = None,
                 attention_type: str = "self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type: str = "p2p", softmax_scale: Optional[float] = None, softmax_type: str = "vanilla",
                 return_max_logit: bool = False, name: Optional[str] = None) -> None:
        super().__init__(name=name)
        refuse_unmodelled("DotProductAttention", window_size=window_size is not None, cp_group=cp_group is not None,
                          softmax_type=softmax_type != "vanilla", return_max_logit=return_max_logit)
        self.qkv_format = qkv_format
        attn_mask_type = attn_mask_type.replace(",", "_")
        self.attn_mask_type = "padding_causal" if attn_mask_type == "causal_padding" else attn_mask_type
        if tp_group is None:
            self.tp_size = tp_size
            if tp_size == 1:
                self.set_tensor_parallel_group(tp_group)
        else:
            self.tp_size = distributed_world_size(tp_group)
            self.set_tensor_parallel_group(tp_group)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.num_attention_heads = num_attention_heads
        self.layer_number = 1 if layer_number is None else layer_number
        self.hidden_size_per_attention_head_k = kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        self.hidden_size_per_attention_head_v = kv_channels if isinstance(kv_channels, int) else kv_channels[1]
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.num_gqa_groups_per_partition = int(self.num_gqa_groups // self.tp_size)
        assert num_attention_heads % self.num_gqa_groups == 0, \
            "The number of attention heads must be divisible by the number of GQA groups!"
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head_k)
        self.softmax_scale = softmax_scale
        self.attention_type = attention_type
        self.attention_dropout = attention_dropout
        self.softmax_type = softmax_type
        self.softmax_offset = None

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask=None, qkv_format: Optional[str] = None, attn_mask_type: Optional[str] = None,
                window_size=None, core_attention_bias_type: str = "no_bias", core_attention_bias=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, **kwargs) -> torch.Tensor:
        qkv_format = self.qkv_format if qkv_format is None else qkv_format
        refuse_unmodelled("DotProductAttention.forward", dropout=self.attention_dropout > 0 and self.training,
                          qkv_format=qkv_format not in ("sbhd", "bshd"), attention_bias=core_attention_bias is not None,
                          window_size=window_size is not None,
                          packed=cu_seqlens_q is not None or cu_seqlens_kv is not None,
                          **{k: v is not None for k, v in kwargs.items() if k not in ("fast_zero_fill",)})
        query_layer = self.prepare_forward(query_layer)
        assert query_layer.dtype == key_layer.dtype == value_layer.dtype, \
            "Queries, keys and values must have the same data type!"
        assert key_layer.shape[:-1] == value_layer.shape[:-1], \
            "Keys and values must have the same batch size, sequence length and number of heads!"
        assert query_layer.shape[-1] == key_layer.shape[-1] == self.hidden_size_per_attention_head_k
        assert value_layer.shape[-1] == self.hidden_size_per_attention_head_v
        assert key_layer.shape[-2] == self.num_gqa_groups_per_partition, \
            f"Keys and values must have num_gqa_group = {self.num_gqa_groups_per_partition} heads! " \
            f"Found {key_layer.shape[-2]}."
        mask = self.attn_mask_type if attn_mask_type is None else attn_mask_type.replace(",", "_")
        mask = "padding_causal" if mask == "causal_padding" else mask
        if mask not in MASKS or attention_mask is not None:
            raise NotImplementedError(f"test double: attention mask {mask!r} (attention_mask given: "
                                      f"{attention_mask is not None}) is not modelled")
        if qkv_format == "sbhd":  # -> [b, h, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))
        else:
            q, k, v = (t.permute(0, 2, 1, 3) for t in (query_layer, key_layer, value_layer))
        heads_per_group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(heads_per_group, dim=1).float() for t in (k, v))
        scores = torch.matmul(q.float(), k.transpose(-1, -2)) * self.softmax_scale
        sq, sk = scores.shape[-2:]
        if mask != "no_mask":
            shift = (sk - sq) if mask == "causal_bottom_right" else 0
            future = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1 + shift)
            scores = scores.masked_fill(future, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v).to(query_layer.dtype)  # [b, h, sq, dv]
        if qkv_format == "sbhd":
            return out.permute(2, 0, 1, 3).reshape(sq, out.shape[0], -1)
        return out.permute(0, 2, 1, 3).reshape(out.shape[0], sq, -1)


__all__ = ["DotProductAttention"]
