"""Test double of transformer_engine/pytorch/tensor/float8_tensor.py (the class only)."""

from transformer_engine.pytorch.tensor import Float8Tensor

__all__ = ["Float8Tensor"]
