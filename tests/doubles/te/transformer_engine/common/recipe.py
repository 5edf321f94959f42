"""Test double of transformer_engine/common/recipe.py: the FP8/FP4 recipe classes megatron-core
subclasses or builds (TEDelayedScaling subclasses DelayedScaling at import). FP8 is not modelled
here: building a recipe raises NotImplementedError, so no FP8 path runs untested."""

from __future__ import annotations

import enum


class Format(enum.Enum):
    """recipe.py `Format`: the FP8 formats."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


class Recipe:
    """recipe.py `Recipe`, the base of every recipe."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"test double: the FP8/FP4 recipe {type(self).__name__} is not modelled")


class DelayedScaling(Recipe):
    pass


class Float8CurrentScaling(Recipe):
    pass


class Float8BlockScaling(Recipe):
    pass


class MXFP8BlockScaling(Recipe):
    pass


class NVFP4BlockScaling(Recipe):
    pass


__all__ = ["DelayedScaling", "Float8BlockScaling", "Float8CurrentScaling", "Format", "MXFP8BlockScaling",
           "NVFP4BlockScaling", "Recipe"]
