"""Test double of Apex's `scaled_upper_triang_masked_softmax_cuda` extension
(csrc/megatron/scaled_upper_triang_masked_softmax.cpp and _cuda.cu, NVIDIA/apex 6424da3), pure
torch: megatron-core's causal fused softmax (fusions/fused_softmax.py ScaledUpperTriangMaskedSoftmax),
used when masked_softmax_fusion is on and FusedScaleMaskSoftmax.is_kernel_available says so.

What it checks, as Apex does: forward takes a 3-D [attn_batches, sq, sk] float16/bfloat16 tensor
(.cpp lines 31-33) with sq <= 16384 (_cuda.cu line 36) and attn_batches a multiple of the batches
per block (scaled_upper_triang_masked_softmax.h line 358); it reads the input's memory as it lies,
so a non-contiguous input (megatron passes a view) is refused here. Backward takes 3-D float16/
bfloat16 gradients and results (.cpp lines 39-47), square (_cuda.cu line 61), and works IN PLACE on
the (contiguous) incoming gradient, which it returns (_cuda.cu lines 54-74).
The maths: tests/doubles/softmax_math.py.
"""

from __future__ import annotations

from tests.doubles import softmax_math as sm


def forward(input, scale_factor):
    sm.check(input.dim() == 3, "expected 3D tensor")
    sm.check_half(input)
    sm.check(input.is_contiguous(), "test double: the kernel would read a non-contiguous input as contiguous")
    attn_batches, sq, sk = input.shape
    sm.check(sq <= 16384, "seq_len <= 16384 INTERNAL ASSERT FAILED")
    sm.check(attn_batches % sm.batch_per_block(sk) == 0, "attn_batches % batches_per_block == 0 INTERNAL ASSERT FAILED")
    return sm.forward(input, scale_factor, causal=True)


def backward(output_grads, softmax_results, scale_factor):
    sm.check(output_grads.dim() == 3, "expected 3D tensor")
    sm.check(softmax_results.dim() == 3, "expected 3D tensor")
    sm.check_half(output_grads)
    sm.check_half(softmax_results)
    grads = output_grads.contiguous()
    sm.check(grads.shape[1] == grads.shape[2], "output_grads.size(1) == output_grads.size(2) INTERNAL ASSERT FAILED")
    grads.copy_(sm.backward(grads, softmax_results.contiguous(), scale_factor))
    return grads
