"""Test double of transformer_engine/pytorch/module/rmsnorm.py and layernorm.py: TE's RMSNorm and
LayerNorm modules (megatron's TENorm builds one of them from config.normalization).

As TE has them: subclasses of the ops (ops/__init__.py here) taking normalized_shape, eps,
sequence_parallel (the "legacy" Megatron flag, copied onto `weight.sequence_parallel` and
`bias.sequence_parallel` at reset_parameters when not None), params_dtype (deprecated alias of
dtype), zero_centered_gamma, and device/dtype/sm_margin passed on to the op."""

from __future__ import annotations

from typing import Optional

import torch

from transformer_engine.pytorch.ops import LayerNorm as LayerNormOp
from transformer_engine.pytorch.ops import RMSNorm as RMSNormOp


def _op_kwargs(params_dtype, kwargs: dict) -> dict:
    if params_dtype is not None:
        if "dtype" in kwargs:
            raise RuntimeError("Both `dtype` and `params_dtype` (deprecated) kwargs are provided")
        kwargs["dtype"] = params_dtype
    return kwargs


class RMSNorm(RMSNormOp):
    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 hidden_size: Optional[int] = None, **kwargs) -> None:
        normalized_shape = hidden_size if normalized_shape is None else normalized_shape
        self.sequence_parallel = sequence_parallel
        super().__init__(normalized_shape, eps=eps, zero_centered_gamma=zero_centered_gamma,
                         **_op_kwargs(params_dtype, kwargs))

    def reset_parameters(self, defer_init: Optional[bool] = None) -> None:
        if defer_init:
            return
        super().reset_parameters()
        if self.sequence_parallel is not None:
            self.weight.sequence_parallel = self.sequence_parallel


class LayerNorm(LayerNormOp):
    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 hidden_size: Optional[int] = None, **kwargs) -> None:
        normalized_shape = hidden_size if normalized_shape is None else normalized_shape
        self.sequence_parallel = sequence_parallel
        super().__init__(normalized_shape, eps=eps, zero_centered_gamma=zero_centered_gamma,
                         **_op_kwargs(params_dtype, kwargs))

    def reset_parameters(self, defer_init: Optional[bool] = None) -> None:
        if defer_init:
            return
        super().reset_parameters()
        if self.sequence_parallel is not None:
            self.weight.sequence_parallel = self.sequence_parallel
            self.bias.sequence_parallel = self.sequence_parallel


__all__ = ["LayerNorm", "RMSNorm"]
