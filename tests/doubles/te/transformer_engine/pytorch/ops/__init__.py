"""Test double of transformer_engine/pytorch/ops (TE's operation-fuser API).

Modelled: the RMSNorm and LayerNorm basic ops (ops/basic/rmsnorm.py, layer_norm.py), which TE's
module-level RMSNorm / LayerNorm (megatron's TENorm) subclass:
- one parameter `weight` of `normalized_shape` (and `bias` for LayerNorm), dtype `dtype` (default:
  torch's default dtype) on `device` (default: the current CUDA device); initialized to 1 (0 with
  zero_centered_gamma) and the bias to 0, unless the device is "meta";
- forward in the WEIGHT's dtype (the input is cast to it: `maybe_dequantize(input, dtype)` with
  dtype = the weight's), the kernel's arithmetic in float32:
      RMSNorm   y = x / sqrt(mean(x^2) + eps) * g          g = weight, or 1 + weight zero-centered
      LayerNorm y = (x - mean(x)) / sqrt(var(x) + eps) * g + bias
- `_extra_state` (ops/op.py get_extra_state ~632): empty uint8 without FP8.
Everything else megatron names from ops (Sequential, BasicLinear, activations, ... used by
use_transformer_engine_op_fuser and fused residual norms, both off here) raises NotImplementedError.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from transformer_engine.pytorch.extra_state import check_extra_state, empty_extra_state
from transformer_engine.pytorch.unmodelled import UnmodelledModule


def normalize(x: torch.Tensor, weight: torch.Tensor, bias, eps: float, zero_centered_gamma: bool,
              kind: str) -> torch.Tensor:
    """TE's normalization kernels' arithmetic, in float32, returned in x's dtype."""
    x32 = x.float()
    gamma = weight.float() + 1 if zero_centered_gamma else weight.float()
    if kind == "RMSNorm":
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * gamma
    else:
        mean = x32.mean(-1, keepdim=True)
        var = (x32 - mean).pow(2).mean(-1, keepdim=True)
        y = (x32 - mean) * torch.rsqrt(var + eps) * gamma + bias.float()
    return y.to(x.dtype)


def default_device(device) -> torch.device:
    """utils.py `canonicalize_device`: None -> the default device if CUDA, else the current CUDA one."""
    if device is None:
        device = torch.get_default_device()
        if device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
    return torch.device(device) if not isinstance(device, torch.device) else device


class FusibleOperation(torch.nn.Module):
    """ops/op.py `FusibleOperation`."""


class BasicOperation(FusibleOperation):
    """ops/op.py `BasicOperation`: holds parameters; its extra state is empty without FP8."""

    def get_extra_state(self) -> torch.Tensor:
        return empty_extra_state()

    def set_extra_state(self, state) -> None:
        check_extra_state(state, type(self).__name__)


class _Norm(BasicOperation):
    kind = "RMSNorm"

    def __init__(self, normalized_shape, *, eps: float = 1e-5, device=None, dtype=None,
                 zero_centered_gamma: bool = False, sm_margin=0) -> None:
        super().__init__()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        shape = tuple(normalized_shape) if isinstance(normalized_shape, Iterable) else (normalized_shape,)
        device = default_device(device)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.register_parameter("weight", torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        if self.kind == "LayerNorm":
            self.register_parameter("bias", torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        if device.type != "meta":
            self.reset_parameters()
        self._sm_margins = {"forward": sm_margin, "backward": sm_margin, "inference": sm_margin}

    def reset_parameters(self) -> None:
        with torch.no_grad():
            (self.weight.zero_() if self.zero_centered_gamma else self.weight.fill_(1.0))
            if self.kind == "LayerNorm":
                self.bias.zero_()

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        dims = tuple(self.weight.shape)
        if tuple(input_.shape[-len(dims):]) != dims:
            raise ValueError(f"Input tensor (shape={tuple(input_.shape)}) and weight tensor (shape={dims}) "
                             "are not compatible")
        x = input_.contiguous().to(self.weight.dtype)
        flat = x.view(-1, *dims).flatten(1)
        y = normalize(flat, self.weight.reshape(-1), getattr(self, "bias", None) if self.kind == "LayerNorm" else None,
                      self.eps, self.zero_centered_gamma, self.kind)
        return y.view(x.shape)


class RMSNorm(_Norm):
    kind = "RMSNorm"


class LayerNorm(_Norm):
    kind = "LayerNorm"


class Sequential(UnmodelledModule):
    pass


class BasicLinear(UnmodelledModule):
    pass


class GroupedLinear(UnmodelledModule):
    pass


class Bias(UnmodelledModule):
    pass


class AllReduce(UnmodelledModule):
    pass


class ReduceScatter(UnmodelledModule):
    pass


class MakeExtraOutput(UnmodelledModule):
    pass


class GELU(UnmodelledModule):
    pass


class GEGLU(UnmodelledModule):
    pass


class ReLU(UnmodelledModule):
    pass


class ReGLU(UnmodelledModule):
    pass


class SiLU(UnmodelledModule):
    pass


class SwiGLU(UnmodelledModule):
    pass


class ScaledSwiGLU(UnmodelledModule):
    pass


__all__ = ["AllReduce", "BasicLinear", "BasicOperation", "Bias", "FusibleOperation", "GEGLU", "GELU", "GroupedLinear",
           "LayerNorm", "MakeExtraOutput", "RMSNorm", "ReGLU", "ReLU", "ReduceScatter", "ScaledSwiGLU", "Sequential",
           "SiLU", "SwiGLU", "default_device", "normalize"]
