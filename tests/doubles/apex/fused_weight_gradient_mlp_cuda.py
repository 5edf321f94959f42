"""Test double of Apex's `fused_weight_gradient_mlp_cuda` extension (csrc/megatron/
fused_weight_gradient_dense.cpp and its two .cu files, NVIDIA/apex 6424da3), pure torch: what
megatron-core's linear layers call in their backward with gradient_accumulation_fusion
(tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication), and whose import
decides whether the fusion may be asked for at all (layers.py `_grad_accum_fusion_available`).

Both functions ACCUMULATE the weight gradient into main_grad: main_grad += d_output^T @ input, the
leading dimensions of input and d_output collapsed with view (so they must be viewable that way).
- wgrad_gemm_accum_fp32 (fused_weight_gradient_dense_cuda.cu lines 58-83): input and d_output of
  one dtype in float32/float16/bfloat16, main_grad float32; the product is summed in float32.
- wgrad_gemm_accum_fp16 (fused_weight_gradient_dense_16bit_prec_cuda.cu lines 49-74): input,
  d_output and main_grad all float16 or all bfloat16 (cuBLAS sums in float32 and writes the
  16-bit result).
"""

from __future__ import annotations

import torch


def _two_d(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, t.shape[-1]) if t.dim() > 2 else t


def _expect(t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:  # data_ptr<T>()
        raise RuntimeError(f"expected scalar type {dtype} but found {t.dtype}")


def _accumulate(input, d_output, d_weight) -> None:
    x, dy = _two_d(input), _two_d(d_output)
    if tuple(d_weight.shape) != (dy.shape[1], x.shape[1]) or x.shape[0] != dy.shape[0]:
        raise RuntimeError(f"test double: shapes input {tuple(x.shape)}, d_output {tuple(dy.shape)}, "
                           f"d_weight {tuple(d_weight.shape)} do not make a weight gradient")
    with torch.no_grad():
        d_weight.copy_((d_weight.float() + dy.float().t() @ x.float()).to(d_weight.dtype))


def wgrad_gemm_accum_fp32(input, d_output, d_weight):
    if input.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise RuntimeError(f"wgrad_gemm_accum_fp32 not implemented for '{input.dtype}'")
    _expect(d_output, input.dtype)
    _expect(d_weight, torch.float32)
    _accumulate(input, d_output, d_weight)


def wgrad_gemm_accum_fp16(input, d_output, d_weight):
    if input.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"wgrad_gemm_accum_fp16 not implemented for '{input.dtype}'")
    _expect(d_output, input.dtype)
    _expect(d_weight, input.dtype)
    _accumulate(input, d_output, d_weight)
