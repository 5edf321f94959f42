"""Test double of transformer_engine/pytorch/float8_tensor.py, TE's legacy alias that megatron-core's
dist_checkpointing imports (strategies/torch.py, exchange_utils.py)."""

from transformer_engine.pytorch.tensor import Float8Tensor

__all__ = ["Float8Tensor"]
