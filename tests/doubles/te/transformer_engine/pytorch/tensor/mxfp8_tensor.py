"""Test double of transformer_engine/pytorch/tensor/mxfp8_tensor.py (the class only)."""

from transformer_engine.pytorch.tensor import MXFP8Tensor

__all__ = ["MXFP8Tensor"]
