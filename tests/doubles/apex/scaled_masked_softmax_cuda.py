"""Test double of Apex's `scaled_masked_softmax_cuda` extension (csrc/megatron/scaled_masked_softmax.cpp
and _cuda.cu, NVIDIA/apex 6424da3), pure torch: megatron-core's padded-mask fused softmax
(fusions/fused_softmax.py ScaledMaskedSoftmax) and the `get_batch_per_block` that
FusedScaleMaskSoftmax.is_kernel_available asks for every fused path, the causal one included.

What it checks, as Apex does: forward takes a 4-D float16/bfloat16 input and a 4-D mask (.cpp
lines 33-36) of shape [1 or b, 1, sq, sk], sq > 1, sk <= 4096 (_cuda.cu lines 43-48,
scaled_masked_softmax.h line 532), sq a multiple of the batches per block (line 551); the mask is
read as bytes, 1 = masked. Backward takes 4-D float16/bfloat16 tensors (.cpp lines 44-52) and
returns a new tensor. The maths: tests/doubles/softmax_math.py.
"""

from __future__ import annotations

import torch

from tests.doubles import softmax_math as sm


def get_batch_per_block(query_seq_len, key_seq_len, batches, attn_heads):
    return sm.batch_per_block(int(key_seq_len))


def forward(input, mask, scale_factor):
    sm.check(input.dim() == 4, "expected 4D tensor")
    sm.check_half(input)
    sm.check(mask.dim() == 4, "expected 4D tensor")
    b, _, sq, sk = input.shape
    sm.check(mask.dtype in (torch.bool, torch.uint8), f"test double: a {mask.dtype} mask would be read as bytes")
    sm.check(sk <= 4096, "key_seq_len >= 0 && key_seq_len <= 4096 INTERNAL ASSERT FAILED")
    sm.check(sq > 1, "query_seq_len > 1 INTERNAL ASSERT FAILED")
    sm.check(mask.shape[0] in (1, b), "pad_batches == 1 || pad_batches == batches INTERNAL ASSERT FAILED")
    sm.check(tuple(mask.shape[1:]) == (1, sq, sk), "mask.size(1) == 1, size(2) == query_seq_len, size(3) == key_seq_len")
    sm.check(sq % sm.batch_per_block(sk) == 0, "query_seq_len % batches_per_block == 0 INTERNAL ASSERT FAILED")
    return sm.forward(input.contiguous(), scale_factor, mask=mask.contiguous())


def backward(output_grads, softmax_results, scale_factor):
    sm.check(output_grads.dim() == 4, "expected 3D tensor")
    sm.check(softmax_results.dim() == 4, "expected 3D tensor")
    sm.check_half(output_grads)
    sm.check_half(softmax_results)
    sm.check(output_grads.shape[-1] <= 4096, "key_seq_len >= 0 && key_seq_len <= 4096 INTERNAL ASSERT FAILED")
    return sm.backward(output_grads.contiguous(), softmax_results.contiguous(), scale_factor)
