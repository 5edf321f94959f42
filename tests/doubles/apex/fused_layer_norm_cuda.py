"""Test double of Apex's `fused_layer_norm_cuda` extension (csrc/layer_norm_cuda.cpp, NVIDIA/apex
6424da3), pure torch: the affine LayerNorm entry points that apex.normalization's
FusedLayerNormAffineFunction calls (megatron-core's FusedLayerNorm, fusions/fused_layer_norm.py).

What the extension checks, as it does (layer_norm_cuda.cpp):
- input, gamma and beta contiguous (CHECK_INPUT, lines 94-96, 151-155);
- normalized_shape at least 1-D and equal to the input's trailing sizes (check_args, lines 30-54),
  gamma and beta shaped normalized_shape (lines 21-24);
- forward: output in the input's dtype (line 99) and gamma/beta read in that dtype (the kernel's
  data_ptr<scalar_t_out>, layer_norm_cuda_kernel.cu line 833): other dtypes are refused; mean and
  invvar in float32 for float16/bfloat16 input (lines 100-105);
- backward: float32, float16, bfloat16 only (no double), dy read in gamma's dtype, float32 input
  with half or bfloat16 gamma allowed (DISPATCH_FLOAT_HALF_AND_BFLOAT_INOUT_TYPES, kernel line 953).
Not modelled: the CUDA-device checks (CHECK_CUDA): the point of the double is to run on the CPU.
The maths: tests/doubles/layer_norm_math.py.
"""

from __future__ import annotations

import torch

from tests.doubles import layer_norm_math

FORWARD_TYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
BACKWARD_IN_OUT = {torch.float32: (torch.float32, torch.float16, torch.bfloat16),
                   torch.float16: (torch.float16,), torch.bfloat16: (torch.bfloat16,)}


def _check_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise RuntimeError(f"{name} must be contiguous")


def _rows_cols(x: torch.Tensor, normalized_shape) -> tuple[int, int]:
    shape = list(normalized_shape)
    if len(shape) < 1:
        raise RuntimeError("Expected normalized_shape to be at least 1-dimensional, i.e., containing at least one "
                           f"element, but got normalized_shape={shape}")
    if x.dim() < len(shape) or list(x.shape[x.dim() - len(shape):]) != shape:
        raise RuntimeError(f"Given normalized_shape={shape}, expected input with shape [*, "
                           f"{', '.join(map(str, shape))}], but got input of size{list(x.shape)}")
    cols = 1
    for s in shape:
        cols *= s
    return x.numel() // cols, cols


def _check_affine(normalized_shape, gamma: torch.Tensor, beta: torch.Tensor) -> None:
    for t in (gamma, beta):
        if list(t.shape) != list(normalized_shape):
            raise RuntimeError(f"Expected a tensor of shape {list(normalized_shape)}, got {list(t.shape)}")


def _expect(t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:  # what at::Tensor::data_ptr<T>() raises
        raise RuntimeError(f"expected scalar type {dtype} but found {t.dtype}")


def forward_affine(input, normalized_shape, gamma, beta, epsilon):
    """(output, mean, invvar): layer_norm_affine, layer_norm_cuda.cpp lines 92-108."""
    _check_contiguous(input=input, gamma=gamma, beta=beta)
    rows, cols = _rows_cols(input, normalized_shape)
    _check_affine(normalized_shape, gamma, beta)
    if input.dtype not in FORWARD_TYPES:
        raise RuntimeError(f"layer_norm_cuda_kernel not implemented for '{input.dtype}'")
    _expect(gamma, input.dtype)
    _expect(beta, input.dtype)
    y, mean, invvar = layer_norm_math.forward(input.reshape(rows, cols), gamma.reshape(cols), beta.reshape(cols),
                                              float(epsilon), input.dtype)
    return y.reshape(input.shape), mean, invvar


def backward_affine(dout, mean, invvar, input_or_output, normalized_shape, gamma, beta, epsilon, memory_efficient):
    """(grad_input, grad_gamma, grad_beta): layer_norm_gradient_affine, layer_norm_cuda.cpp lines 147-164;
    `mean` is None when memory_efficient (the caller saved the output instead of the input)."""
    _check_contiguous(dout=dout, invvar=invvar, input_or_output=input_or_output, gamma=gamma, beta=beta)
    rows, cols = _rows_cols(input_or_output, normalized_shape)
    _check_affine(normalized_shape, gamma, beta)
    allowed = BACKWARD_IN_OUT.get(input_or_output.dtype)
    if allowed is None:
        raise RuntimeError(f"cuComputeGradInput not implemented for '{input_or_output.dtype}'")
    if gamma.dtype not in allowed:
        raise RuntimeError(f"cuComputeGradInput not implemented for '{gamma.dtype}'")
    _expect(dout, gamma.dtype)
    _expect(beta, gamma.dtype)
    _expect(invvar, torch.float32)
    if mean is not None:
        _expect(mean, torch.float32)
    elif not memory_efficient:
        raise RuntimeError("mean is required unless memory_efficient")
    dx, dgamma, dbeta = layer_norm_math.backward(
        dout.reshape(rows, cols), input_or_output.reshape(rows, cols), mean, invvar, gamma.reshape(cols),
        beta.reshape(cols), float(epsilon), memory_efficient=bool(memory_efficient), clamp=True)
    return dx.reshape(input_or_output.shape), dgamma.reshape(gamma.shape), dbeta.reshape(beta.shape)
