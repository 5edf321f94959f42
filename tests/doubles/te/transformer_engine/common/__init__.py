"""Test double of transformer_engine.common: the recipes megatron-core names (FP8, not modelled)."""

from transformer_engine.common import recipe

__all__ = ["recipe"]
