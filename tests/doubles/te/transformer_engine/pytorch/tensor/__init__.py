"""Test double of transformer_engine/pytorch/tensor: the quantized tensor classes megatron-core
checks parameters against (isinstance; megatron/core/fp8_utils.py). Without FP8 no tensor is one
of them, which is what these empty subclasses give; building one is not modelled."""

from __future__ import annotations

import torch


class QuantizedTensor(torch.Tensor):
    """quantized_tensor.py `QuantizedTensor`, the base of TE's FP8/FP4 tensors."""

    def __new__(cls, *args, **kwargs):
        raise NotImplementedError(f"test double: {cls.__name__} (FP8/FP4 tensors) is not modelled")


class Float8Tensor(QuantizedTensor):
    pass


class MXFP8Tensor(QuantizedTensor):
    pass


class Float8BlockwiseQTensor(QuantizedTensor):
    pass


class NVFP4Tensor(QuantizedTensor):
    pass


__all__ = ["Float8BlockwiseQTensor", "Float8Tensor", "MXFP8Tensor", "NVFP4Tensor", "QuantizedTensor"]
