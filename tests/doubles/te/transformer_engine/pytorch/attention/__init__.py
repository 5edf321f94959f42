"""Test double of transformer_engine/pytorch/attention: DotProductAttention and the rotary embedding.

As in TE 2.20 (attention/__init__.py), the package does not export `_SplitAlongDim` nor
`apply_rotary_pos_emb`: megatron-core's imports of them from here fail, so its attention splits
Q/K/V with torch.split and takes the rotary embedding from attention.rope, as on a GPU node."""

from transformer_engine.pytorch.attention import rope
from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention

__all__ = ["DotProductAttention", "rope"]
