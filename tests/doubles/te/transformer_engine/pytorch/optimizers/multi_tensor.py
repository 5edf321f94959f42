"""Test double of TE's multi-tensor kernels as megatron-core calls them (clip_grads.py, optimizer.py).

- multi_tensor_applier (optimizers/multi_tensor_apply.py): `MultiTensorApply(2048 * 32)`; a call
  checks the lists are aligned (RuntimeError otherwise), drops the slots whose first-list tensor
  is empty, returns None when nothing is left, else op(chunk_size, noop_flag, lists, *args).
- multi_tensor_l2norm (csrc/extensions/multi_tensor/l2norm.cpp): (the global L2 norm as a float32
  tensor of shape [1], per-tensor norms [n] when asked, else an empty float32 tensor), the sums
  in float32.
- multi_tensor_scale / multi_tensor_scale_tensor (common/multi_tensor/scale.cu): out = in * scale,
  computed in float32 and stored in out's dtype; a non-finite INPUT sets noop_flag to 1 (the
  scaled values are written anyway). The _tensor variant reads the scale from a tensor.
"""

from __future__ import annotations

import torch


class MultiTensorApply:
    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        if any(len(tensors) != len(tensor_lists[0]) for tensors in tensor_lists):
            raise RuntimeError("Expected aligned multi-tensor lists.")
        keep = [t.numel() > 0 for t in tensor_lists[0]]
        for i, tensors in enumerate(tensor_lists):
            tensor_lists[i] = [t for t, k in zip(tensors, keep) if k]
        if not tensor_lists[0]:
            return None
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, per_tensor: bool | None = False):
    tensors = tensor_lists[0]
    norms = torch.stack([t.detach().float().pow(2).sum() for t in tensors])
    total = norms.sum().sqrt().reshape(1)
    per = norms.sqrt() if per_tensor else torch.empty(0, dtype=torch.float32, device=total.device)
    return total, per


def _scale(noop_flag: torch.Tensor, tensor_lists, scale) -> None:
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        src32 = src.detach().float()
        if not torch.isfinite(src32).all():
            noop_flag.fill_(1)
        dst.copy_((src32 * scale).to(dst.dtype))


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float) -> None:
    _scale(noop_flag, tensor_lists, float(scale))


def multi_tensor_scale_tensor(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: torch.Tensor) -> None:
    _scale(noop_flag, tensor_lists, scale.detach().float().reshape(()))


__all__ = ["MultiTensorApply", "multi_tensor_applier", "multi_tensor_l2norm", "multi_tensor_scale",
           "multi_tensor_scale_tensor"]
