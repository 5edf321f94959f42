"""Test double of Apex's `scaled_softmax_cuda` extension (csrc/megatron/scaled_softmax.cpp and
_cuda.cu, NVIDIA/apex 6424da3), pure torch: megatron-core's unmasked fused softmax
(fusions/fused_softmax.py ScaledSoftmax, a non-causal attention without a mask).

What it checks, as Apex does: forward takes a 4-D float16/bfloat16 input (.cpp lines 31-33) with
sk <= 16384 and sq a multiple of the batches per block (scaled_masked_softmax.h lines 438, 457);
backward 4-D float16/bfloat16 tensors (.cpp lines 39-47). The maths: tests/doubles/softmax_math.py.
"""

from __future__ import annotations

from tests.doubles import softmax_math as sm


def forward(input, scale_factor):
    sm.check(input.dim() == 4, "expected 4D tensor")
    sm.check_half(input)
    sm.check(input.is_contiguous(), "test double: the kernel would read a non-contiguous input as contiguous")
    _, _, sq, sk = input.shape
    sm.check(sk <= 16384, "key_seq_len >= 0 && key_seq_len <= 16384 INTERNAL ASSERT FAILED")
    sm.check(sq % sm.batch_per_block(sk) == 0, "query_seq_len % batches_per_block == 0 INTERNAL ASSERT FAILED")
    return sm.forward(input, scale_factor)


def backward(output_grads, softmax_results, scale_factor):
    sm.check(output_grads.dim() == 4, "expected 3D tensor")
    sm.check(softmax_results.dim() == 4, "expected 3D tensor")
    sm.check_half(output_grads)
    sm.check_half(softmax_results)
    return sm.backward(output_grads.contiguous(), softmax_results.contiguous(), scale_factor)
