"""Test double of apex/contrib/layer_norm/layer_norm.py (NVIDIA/apex 6424da3), pure torch:
FastLayerNormFN, megatron-core's persistent LayerNorm (fusions/fused_layer_norm.py), over the
`fast_layer_norm` extension (here the double tests/doubles/apex/fast_layer_norm.py).

As Apex has it (lines 8-36): the extension is imported with this module (line 5); forward takes
`memory_efficient` (megatron looks for it by name); x is flattened to [-1, gamma.numel()]; with
memory_efficient the output (not the input) and beta are saved, otherwise the input and the mean;
the output is a VIEW of the kernel's 2-D result, shaped as x (megatron makes it viewless);
backward returns gradients for x, gamma and beta. FastLayerNorm (lines 45-59) without autocast
handling (not modelled: the CPU has no CUDA autocast).
"""

from __future__ import annotations

import fast_layer_norm
import torch
from torch.nn import init


class FastLayerNormFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, epsilon, memory_efficient=False):
        ctx.x_shape, ctx.memory_efficient = x.shape, memory_efficient
        gamma, beta = gamma.contiguous(), beta.contiguous()
        xmat = x.contiguous().view(-1, gamma.numel())
        ymat, mu, rsigma = fast_layer_norm.ln_fwd(xmat, gamma, beta, epsilon)
        ctx.save_for_backward(*((ymat, gamma, None, rsigma, beta) if memory_efficient
                                else (xmat, gamma, mu, rsigma, None)))
        return ymat.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x_or_y_mat, gamma, mu, rsigma, beta = ctx.saved_tensors
        dxmat, dgamma, dbeta, _, _ = fast_layer_norm.ln_bwd(dy.contiguous().view(x_or_y_mat.shape), x_or_y_mat, mu,
                                                            rsigma, gamma, beta, ctx.memory_efficient)
        return dxmat.view(ctx.x_shape), dgamma, dbeta, None, None


class FastLayerNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-5, memory_efficient=False):
        super().__init__()
        self.epsilon, self.memory_efficient = eps, memory_efficient
        self.weight = torch.nn.Parameter(torch.empty(hidden_size))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size))
        self.reset_parameters()

    def reset_parameters(self):
        init.ones_(self.weight)
        init.zeros_(self.bias)

    def forward(self, x):
        return FastLayerNormFN.apply(x, self.weight, self.bias, self.epsilon, self.memory_efficient)
