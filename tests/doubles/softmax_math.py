"""The arithmetic of Apex's fused softmax kernels for Megatron (csrc/megatron/, NVIDIA/apex 6424da3),
in plain torch (test double). Shared by the three extension doubles in tests/doubles/apex/
(scaled_upper_triang_masked_softmax_cuda, scaled_masked_softmax_cuda, scaled_softmax_cuda).

    forward   the scale is first rounded to the input's dtype (the dispatchers take
              `const input_t scale`: scaled_masked_softmax.h lines 436 and 529,
              scaled_upper_triang_masked_softmax.h line 335); in float32: x * scale, masked entries
              set (causal: excluded, their output 0; masked: -10000, and a row whose maximum is -10000
              gives zeros, scaled_masked_softmax.h lines 265-297), softmax, cast to the input's dtype
    backward  in float32 with the scale NOT rounded (`const acc_t scale`): scale * y * (dy - sum(dy * y))
              (scaled_masked_softmax.h line 412), cast to the gradient's dtype

`batch_per_block` is get_batch_per_block (scaled_masked_softmax.h lines 421-433) with a 32-thread warp.
"""

from __future__ import annotations

import torch

HALF_TYPES = (torch.float16, torch.bfloat16)
WARP_SIZE = 32  # C10_WARP_SIZE on NVIDIA GPUs
MASKED = -10000.0


def batch_per_block(key_seq_len: int) -> int:
    next_pow2 = 1 << max(0, (key_seq_len - 1).bit_length())
    warp_size = min(next_pow2, WARP_SIZE)
    batches_per_warp = 2 if next_pow2 <= 128 else 1
    return (128 // warp_size) * batches_per_warp


def as_float(scale) -> float:
    """A C++ `float` argument: Megatron passes a 0-dim float32 tensor (fused_softmax.py scale_t[0])."""
    return float(torch.tensor(float(scale), dtype=torch.float32))


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def check_half(t: torch.Tensor) -> None:
    check(t.dtype in HALF_TYPES, "Only fp16 and bf16 are supported")


def rounded_scale(scale, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(as_float(scale), dtype=dtype).float()


def forward(x: torch.Tensor, scale, *, mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """x: [..., sq, sk] in float16/bfloat16; mask: bool/uint8 broadcastable to x, 1 = masked."""
    logits = x.float() * rounded_scale(scale, x.dtype)
    if causal:
        sq, sk = x.shape[-2:]
        above = torch.ones(sq, sk, dtype=torch.bool).triu(1)
        probs = torch.softmax(logits.masked_fill(above, float("-inf")), dim=-1)
        return probs.to(x.dtype)
    if mask is not None:
        masked = mask.to(torch.uint8) == 1
        logits = logits.masked_fill(masked, MASKED)
        probs = torch.softmax(logits, dim=-1)
        full = logits.amax(dim=-1, keepdim=True) == MASKED  # the kernel's test for a fully masked row
        return torch.where(full, torch.zeros_like(probs), probs).to(x.dtype)
    return torch.softmax(logits, dim=-1).to(x.dtype)


def backward(dy: torch.Tensor, y: torch.Tensor, scale) -> torch.Tensor:
    g, p = dy.float(), y.float()
    s = as_float(scale)
    return (s * (g * p - p * (g * p).sum(dim=-1, keepdim=True))).to(dy.dtype)
