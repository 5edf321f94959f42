"""Test double of Apex's `amp_C` extension (csrc/amp_C_frontend.cpp, NVIDIA/apex 6424da3), pure
torch: the multi-tensor kernels megatron-core calls through apex.multi_tensor_apply
(optimizer/clip_grads.py: multi_tensor_l2norm, multi_tensor_scale; optimizer/optimizer.py:
multi_tensor_scale) and the one apex.optimizers.FusedSGD calls (multi_tensor_sgd).

What every kernel checks before it runs, as csrc/multi_tensor_apply.cuh does (lines 35-51): as
many tensor lists as the kernel's depth, a non-empty first list, lists of one length, each tensor
contiguous, on the first tensor's device, and with the numel of its partner in the first list.
The noop flag is an int32 tensor (read through data_ptr<int>, line 82). A kernel dispatches on the
dtype of each list's FIRST tensor and reads the others as that dtype (type_shim.h
DISPATCH_FLOAT_HALF_AND_BFLOAT): a list of mixed dtypes is garbage on the GPU and refused here.
Not modelled: the CUDA-device check (line 39); the chunking (results do not depend on it beyond
float rounding).
"""

from __future__ import annotations

import torch

KERNEL_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(name: str, depth: int, noop_flag, tensor_lists) -> None:
    if not isinstance(noop_flag, torch.Tensor):
        raise TypeError(f"{name}(): incompatible function arguments: noop_flag must be a Tensor, got {type(noop_flag)}")
    if noop_flag.dtype != torch.int32:
        raise RuntimeError(f"expected scalar type Int but found {noop_flag.dtype}")
    if len(tensor_lists) != depth:
        raise RuntimeError("tensor_lists.size() != depth")
    if len(tensor_lists[0]) == 0:
        raise RuntimeError("tensor_lists[0].size() is not > 0")
    device = tensor_lists[0][0].device
    for tensors in tensor_lists:
        if len(tensors) != len(tensor_lists[0]):
            raise RuntimeError("Size mismatch among tensor lists")
        for t, first in zip(tensors, tensor_lists[0]):
            if not t.is_contiguous():
                raise RuntimeError("A tensor was not contiguous.")
            if t.device != device:
                raise RuntimeError("A tensor was not on the same device as the first tensor")
            if t.numel() != first.numel():
                raise RuntimeError("Size mismatch")
    for tensors in tensor_lists:
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise RuntimeError(f"test double: {name} would read a list of mixed dtypes {sorted(map(str, dtypes))} "
                               f"as {tensors[0].dtype}")


def _dispatch(name: str, dtype: torch.dtype) -> None:
    if dtype not in KERNEL_TYPES:
        raise RuntimeError(f"{name} not implemented for '{dtype}'")


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """out = in * scale in float32 arithmetic (scale is a C float), for [ins, outs]; sets the noop
    flag to 1 when an input is not finite, and still writes (csrc/multi_tensor_scale_kernel.cu
    lines 60-61, 92: "I'd like this kernel to propagate infs/nans")."""
    _check("multi_tensor_scale", 2, noop_flag, tensor_lists)
    _dispatch("multi_tensor_scale_cuda", tensor_lists[0][0].dtype)
    _dispatch("multi_tensor_scale_cuda", tensor_lists[1][0].dtype)
    s = torch.tensor(float(scale), dtype=torch.float32)
    finite = True
    for src, dst in zip(*tensor_lists):
        finite = finite and bool(torch.isfinite(src).all())
        dst.copy_((src.float() * s).to(dst.dtype))
    if not finite:
        noop_flag.fill_(1)


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor_python=None):
    """(total L2 norm [1], per-tensor norms [n] or [0]), float32 on the tensors' device, the squares
    summed in float32 (csrc/multi_tensor_l2norm_kernel.cu lines 290-335); the noop flag is set when
    the sum is not finite (line 85)."""
    _check("multi_tensor_l2norm", 1, noop_flag, tensor_lists)
    _dispatch("multi_tensor_l2norm_cuda", tensor_lists[0][0].dtype)
    per_tensor = bool(per_tensor_python) if per_tensor_python is not None else False
    squares = torch.stack([t.float().square().sum() for t in tensor_lists[0]])
    if not bool(torch.isfinite(squares).all()):
        noop_flag.fill_(1)
    device = tensor_lists[0][0].device
    total = squares.sum().sqrt().reshape(1).to(device)
    norms = squares.sqrt().to(device) if per_tensor else torch.empty(0, dtype=torch.float32, device=device)
    return total, norms


# The dtype combinations multi_tensor_sgd_cuda runs (csrc/multi_tensor_sgd_kernel.cu lines 141-181):
# (grad, weight, number of lists).
SGD_CASES = {(torch.float16, torch.float16, 3), (torch.float32, torch.float32, 3),
             (torch.float16, torch.float32, 4), (torch.float32, torch.float32, 4)}


def multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr, nesterov, first_run,
                     wd_after_momentum, scale):
    """SGD on [grads, weights, momenta(, fp16 weight copies)], in float32 (multi_tensor_sgd_kernel.cu
    lines 28-114): nothing when the noop flag is already set; g = grad * scale; weight decay before
    or after momentum; at the first run the momentum becomes g (not a blend); w -= lr * g."""
    _check("multi_tensor_sgd", len(tensor_lists), noop_flag, tensor_lists)
    depth = len(tensor_lists)
    if depth == 4 and any(t.dtype != torch.float16 for t in tensor_lists[3]):
        raise RuntimeError("Additional output tensors should always be fp16.")
    grad_type, weight_type = tensor_lists[0][0].dtype, tensor_lists[1][0].dtype
    if (grad_type, weight_type, depth) not in SGD_CASES:
        raise RuntimeError("multi_tensor_sgd only supports some combinations of gradient & weight types. Given: "
                           f"gradient: {grad_type}, weight: {weight_type}, num_lists: {depth}")
    if int(noop_flag.item()) != 0:
        return
    f32 = lambda v: torch.tensor(float(v), dtype=torch.float32)  # noqa: E731 - the kernel's float arguments
    wd, momentum, dampening, lr, scale = f32(wd), f32(momentum), f32(dampening), f32(lr), f32(scale)
    for i in range(len(tensor_lists[0])):
        grad, weight, mom = tensor_lists[0][i], tensor_lists[1][i], tensor_lists[2][i]
        g, w, m = grad.float() * scale, weight.float(), mom.float()
        if wd != 0 and not wd_after_momentum:
            g = g + wd * w
        if momentum != 0:
            m = g if first_run else m * momentum + (1 - dampening) * g
            g = g + momentum * m if nesterov else m
        if wd != 0 and wd_after_momentum:
            g = g + wd * w
        weight.copy_((w + (-lr * g)).to(weight.dtype))
        if depth == 4:
            tensor_lists[3][i].copy_(weight.to(torch.float16))
        if momentum != 0:
            mom.copy_(m.to(mom.dtype))
