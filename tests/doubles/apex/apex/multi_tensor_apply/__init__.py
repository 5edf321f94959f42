"""apex.multi_tensor_apply (apex/multi_tensor_apply/__init__.py line 3): the applier every fused
Apex optimizer and megatron-core's gradient clipping call, with Apex's chunk size 2048 * 32."""

from apex.multi_tensor_apply.multi_tensor_apply import MultiTensorApply

multi_tensor_applier = MultiTensorApply(2048 * 32)

__all__ = ["MultiTensorApply", "multi_tensor_applier"]
