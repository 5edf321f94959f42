"""Test double of Apex's contrib `fast_layer_norm` extension (apex/contrib/csrc/layer_norm/ln_api.cpp,
NVIDIA/apex 6424da3), pure torch: the kernels behind apex.contrib.layer_norm's FastLayerNormFN,
megatron-core's "persistent" LayerNorm (fusions/fused_layer_norm.py, persist_layer_norm).

What it checks, as ln_api.cpp does:
- a kernel exists only for the registered hidden sizes and type combinations (ln_fwd_cuda_kernel.cu,
  ln_bwd_semi_cuda_kernel.cu REGISTER_*_LAUNCHER): weights float32, float16 or bfloat16, input of
  the weights' dtype or float32, output in the weights' dtype (ln_api.cpp lines 6-22, 87-90); other
  sizes or types raise "Unsupported hidden_size or types" (lines 59-79);
- forward: beta's dtype is gamma's, x contiguous and 2-D, gamma and beta one shape, the hidden size
  x's width, epsilon >= 0 (lines 92-109); mean and rsigma float32 (lines 115-116);
- backward: dz in the output dtype, rsigma (and mu) float32, x_or_z and dz contiguous, 2-D, one
  shape (lines 170-199); returns dx (x_or_z's dtype), dgamma, dbeta (gamma's) and the float32 partial
  sums of dgamma and dbeta (lines 202-255; here one partial row, which holds the sums).
Not modelled: the CUDA-device checks. The maths: tests/doubles/layer_norm_math.py (no gamma clamp).
"""

from __future__ import annotations

import torch

from tests.doubles import layer_norm_math

HIDDEN_SIZES = (768, 1024, 1536, 2048, 2304, 3072, 3840, 4096, 5120, 6144, 8192, 10240, 12288, 12800, 14336, 15360,
                16384, 18432, 20480, 24576, 25600, 30720, 32768, 40960, 49152, 65536)
WEIGHT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def _launcher(direction: str, wtype, itype, hidden: int) -> None:
    if hidden not in HIDDEN_SIZES or wtype not in WEIGHT_TYPES or itype not in (wtype, torch.float32):
        raise RuntimeError(f"{direction}: Unsupported hidden_size or types: {hidden}{wtype}{itype}{wtype}{torch.float32}")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"Expected {what} to be true, but got false.")


def ln_fwd(x, gamma, beta, epsilon):
    _require(beta.dtype == gamma.dtype, "beta.scalar_type() == wtype")
    _require(x.is_contiguous(), "x.is_contiguous()")
    _require(x.dim() == 2, "sizes.size() == 2")
    hidden = gamma.numel()
    _require(gamma.shape == beta.shape, "gamma.sizes() == beta.sizes()")
    _require(hidden == x.shape[1], "hidden_size == cols")
    _require(epsilon >= 0.0, "epsilon >= 0.f")
    _launcher("FWD", gamma.dtype, x.dtype, hidden)
    eps = float(torch.tensor(epsilon, dtype=torch.float32))  # a C float
    return list(layer_norm_math.forward(x, gamma.reshape(-1), beta.reshape(-1), eps, gamma.dtype))


def ln_bwd(dz, x_or_z, mu, rsigma, gamma, beta, memory_efficient):
    _require(dz.dtype == gamma.dtype, "dz.dtype() == otype")
    _require(rsigma.dtype == torch.float32, "rsigma.dtype() == ctype")
    _require(mu is None or mu.dtype == torch.float32, "mu_.value().dtype() == ctype")
    _require(beta is None or beta.dtype == gamma.dtype, "beta_.value().dtype() == wtype")
    _require(x_or_z.is_contiguous(), "x_or_z.is_contiguous()")
    _require(dz.is_contiguous(), "dz.is_contiguous()")
    _require(x_or_z.dim() == 2, "sizes.size() == 2")
    _require(dz.shape == x_or_z.shape, "dz.sizes() == sizes")
    _require(gamma.numel() == x_or_z.shape[1], "gamma.numel() == cols")
    _require(beta is None or beta.numel() == x_or_z.shape[1], "beta_.value().numel() == cols")
    _launcher("BWD", gamma.dtype, x_or_z.dtype, gamma.numel())
    if memory_efficient and beta is None:
        raise RuntimeError("bad optional access")  # beta_.value() with no beta
    if not memory_efficient and mu is None:
        raise RuntimeError("bad optional access")  # mu_.value() with no mu
    g = gamma.reshape(-1)
    b = beta.reshape(-1) if beta is not None else torch.zeros_like(g)
    dx, dgamma, dbeta = layer_norm_math.backward(dz, x_or_z, mu, rsigma, g, b, 0.0,
                                                 memory_efficient=bool(memory_efficient), clamp=False)
    parts = [dgamma.float().reshape(1, -1), dbeta.float().reshape(1, -1)]
    return [dx, dgamma.reshape(gamma.shape), dbeta.reshape(gamma.shape), *parts]
