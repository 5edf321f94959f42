"""The arithmetic of Apex's two LayerNorm kernels, in plain torch (test double).

Both kernels work on a [rows, cols] view (one row per normalized vector) and keep their statistics
in a float type U: float32 for float32/float16/bfloat16 input, float64 for float64 input (Apex
csrc/layer_norm_cuda_kernel.cu `cuda_layer_norm`, at::acc_type; apex/contrib/csrc/layer_norm is
always float32):

    forward   mean = mean(x);  invvar = 1 / sqrt(var(x) + eps)      (biased variance, in U)
              y = gamma * cast_V((x - mean) * invvar) + beta        (V: gamma's dtype, the output's)
    backward  xhat = (x - mean) * invvar, or from the output: (y - beta) / gamma
              dgamma = sum_rows(dy * xhat);  dbeta = sum_rows(dy)
              dx = invvar / cols * (cols * dy * gamma - sum(dy * gamma) - xhat * sum(dy * gamma * xhat))

csrc/layer_norm_cuda_kernel.cu (NVIDIA/apex 6424da3) clamps gamma away from zero by eps where it
divides or scales by it (`clamp_by_magnitude`, line 379, used at 416 and 755); the contrib
kernel does not (apex/contrib/csrc/layer_norm/ln_bwd_kernels.cuh line 103).
"""

from __future__ import annotations

import torch


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """U for an input dtype (layer_norm_cuda.cpp lines 100-103: float for half and bfloat16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def forward(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float, out_dtype: torch.dtype):
    """x: [rows, cols]. Returns (y in out_dtype, mean [rows] U, invvar [rows] U)."""
    u = stats_dtype(x.dtype)
    xu = x.to(u)
    mean = xu.mean(dim=1)
    var = (xu - mean[:, None]).square().mean(dim=1)
    invvar = torch.rsqrt(var + eps)
    normed = ((xu - mean[:, None]) * invvar[:, None]).to(out_dtype)
    return gamma.to(out_dtype) * normed + beta.to(out_dtype), mean, invvar


def clamp_by_magnitude(gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """|gamma| at least eps, sign kept (zero counts as positive)."""
    floor = torch.full_like(gamma, eps)
    return torch.where(gamma >= 0, torch.maximum(gamma, floor), torch.minimum(gamma, -floor))


def backward(dy: torch.Tensor, x_or_y: torch.Tensor, mean: torch.Tensor | None, invvar: torch.Tensor,
             gamma: torch.Tensor, beta: torch.Tensor, eps: float, *, memory_efficient: bool, clamp: bool):
    """dy, x_or_y: [rows, cols] (x_or_y is the output y when memory_efficient). Returns
    (dx in x_or_y's dtype, dgamma and dbeta in gamma's dtype)."""
    u = invvar.dtype
    rows, cols = x_or_y.shape
    g = gamma.to(u)
    g_scale = clamp_by_magnitude(gamma, eps).to(u) if clamp else g
    h, d = x_or_y.to(u), dy.to(u)
    xhat = (h - beta.to(u)) / g_scale if memory_efficient else (h - mean[:, None]) * invvar[:, None]
    dgamma = (d * xhat).sum(dim=0)
    dbeta = d.sum(dim=0)
    sum1 = (d * g).sum(dim=1, keepdim=True)
    # from the output, the kernel sums dy * (y - beta): gamma unclamped (lines 630, 649)
    sum2 = (d * (h - beta.to(u)) if memory_efficient else d * g * xhat).sum(dim=1, keepdim=True)
    dx = (cols * d * g_scale - sum1 - xhat * sum2) * (invvar[:, None] / cols)
    return dx.to(x_or_y.dtype), dgamma.to(gamma.dtype), dbeta.to(gamma.dtype)
