"""Test double of transformer_engine/pytorch/fp8.py: TE's deprecated alias of quantization.py, which
megatron-core imports. As in TE (fp8.py lines 9-14), importing it warns (a DeprecationWarning,
hidden by Python's default filters)."""

import warnings

from transformer_engine.pytorch.quantization import (FP8GlobalStateManager, autocast, fp8_autocast, fp8_model_init,
                                                     quantized_model_init)

warnings.warn("Using deprecated internal API from Transformer Engine. transformer_engine.pytorch.fp8 will be "
              "removed in a future release.", DeprecationWarning, stacklevel=2)

__all__ = ["FP8GlobalStateManager", "autocast", "fp8_autocast", "fp8_model_init", "quantized_model_init"]
