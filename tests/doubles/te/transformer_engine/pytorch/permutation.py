"""Test double of transformer_engine/pytorch/permutation.py: megatron's fused token permutation
(moe_permute_fusion, off in this project). Not modelled: each raises NotImplementedError."""

from transformer_engine.pytorch.unmodelled import unmodelled

moe_permute = unmodelled("permutation.moe_permute")
moe_permute_with_probs = unmodelled("permutation.moe_permute_with_probs")
moe_permute_and_pad_with_probs = unmodelled("permutation.moe_permute_and_pad_with_probs")
moe_sort_chunks_by_index = unmodelled("permutation.moe_sort_chunks_by_index")
moe_sort_chunks_by_index_with_probs = unmodelled("permutation.moe_sort_chunks_by_index_with_probs")
moe_unpermute = unmodelled("permutation.moe_unpermute")
