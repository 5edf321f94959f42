"""Test double of transformer_engine/pytorch/optimizers: what megatron-core 0.19.2 imports from it
(optimizer/__init__.py: FusedAdam, FusedSGD; optimizer.py and clip_grads.py: multi_tensor_applier,
multi_tensor_scale, multi_tensor_l2norm, multi_tensor_scale_tensor)."""

from transformer_engine.pytorch.optimizers.fused_adam import FusedAdam
from transformer_engine.pytorch.optimizers.fused_sgd import FusedSGD
from transformer_engine.pytorch.optimizers.multi_tensor import (MultiTensorApply, multi_tensor_applier,
                                                                 multi_tensor_l2norm, multi_tensor_scale,
                                                                 multi_tensor_scale_tensor)

__all__ = ["FusedAdam", "FusedSGD", "MultiTensorApply", "multi_tensor_applier", "multi_tensor_l2norm",
           "multi_tensor_scale", "multi_tensor_scale_tensor"]
