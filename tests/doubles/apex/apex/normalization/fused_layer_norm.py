"""Test double of apex.normalization.fused_layer_norm's FusedLayerNormAffineFunction
(apex/normalization/fused_layer_norm.py lines 38-74, NVIDIA/apex 6424da3), pure torch: the autograd
function megatron-core's FusedLayerNorm (fusions/fused_layer_norm.py) applies when its persistent
kernel is off.

As Apex has it: the `fused_layer_norm_cuda` extension is imported at the first forward, not at
import (lines 41-43; here the double tests/doubles/apex/fused_layer_norm_cuda.py); forward takes
`memory_efficient` (megatron looks for that argument by name, with inspect); the input, weight and
bias are made contiguous; with memory_efficient the OUTPUT is saved for the backward instead of the
input, and no mean; backward returns gradients for input, weight and bias only.
"""

from __future__ import annotations

import importlib

import torch

fused_layer_norm_cuda = None


def extension():
    """The extension module, imported once on first use (as Apex's module-level global)."""
    global fused_layer_norm_cuda
    if fused_layer_norm_cuda is None:
        fused_layer_norm_cuda = importlib.import_module("fused_layer_norm_cuda")
    return fused_layer_norm_cuda


class FusedLayerNormAffineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        ctx.normalized_shape, ctx.eps, ctx.memory_efficient = normalized_shape, eps, memory_efficient
        x, w, b = input.contiguous(), weight.contiguous(), bias.contiguous()
        output, mean, invvar = extension().forward_affine(x, normalized_shape, w, b, eps)
        saved = (output, w, b, None, invvar) if memory_efficient else (x, w, b, mean, invvar)
        ctx.save_for_backward(*saved)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_or_output, weight, bias, mean, invvar = ctx.saved_tensors
        grad_input, grad_weight, grad_bias = extension().backward_affine(
            grad_output.contiguous(), mean, invvar, input_or_output, ctx.normalized_shape, weight, bias, ctx.eps,
            ctx.memory_efficient)
        return grad_input, grad_weight, grad_bias, None, None, None
