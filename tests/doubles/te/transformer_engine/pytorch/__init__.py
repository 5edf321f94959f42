"""Test double of transformer_engine.pytorch (TE 2.20.2): the names megatron-core 0.19.2 takes from
it on this project's paths, as TE's own __init__.py exports them. See the package docstring of
transformer_engine (tests/doubles/te/transformer_engine/__init__.py) for what is not modelled."""

from transformer_engine.pytorch import distributed, ops, optimizers
from transformer_engine.pytorch.attention import DotProductAttention
from transformer_engine.pytorch.cpu_offload import get_cpu_offload_context
from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker, checkpoint
from transformer_engine.pytorch.module import (Fp8Padding, Fp8Unpadding, GroupedLinear, LayerNorm, LayerNormLinear,
                                               LayerNormMLP, Linear, RMSNorm)
from transformer_engine.pytorch.permutation import (moe_permute, moe_permute_and_pad_with_probs, moe_permute_with_probs,
                                                    moe_sort_chunks_by_index, moe_sort_chunks_by_index_with_probs,
                                                    moe_unpermute)
from transformer_engine.pytorch.quantization import autocast, fp8_autocast, fp8_model_init, quantized_model_init
from transformer_engine.pytorch.tensor import Float8Tensor, MXFP8Tensor, QuantizedTensor

__all__ = ["CudaRNGStatesTracker", "DotProductAttention", "Float8Tensor", "Fp8Padding", "Fp8Unpadding", "GroupedLinear",
           "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "MXFP8Tensor", "QuantizedTensor", "RMSNorm",
           "autocast", "checkpoint", "distributed", "fp8_autocast", "fp8_model_init", "get_cpu_offload_context",
           "moe_permute", "moe_permute_and_pad_with_probs", "moe_permute_with_probs", "moe_sort_chunks_by_index",
           "moe_sort_chunks_by_index_with_probs", "moe_unpermute", "ops", "optimizers", "parallel_cross_entropy",
           "quantized_model_init"]
