"""The Apex world's stand-ins (tests/doubles/apex/) pin what they copy from Apex (NVIDIA/apex 6424da3,
the Apex of NGC's PyTorch images), each against an independent reference (torch's own LayerNorm,
SGD and softmax, float64 sums), and megatron-core 0.19.2 takes its Apex branches with them.

Every check runs in ONE fresh interpreter of the Apex world (worlds.drive_in_world: the pytest
process is the local world, where `apex` does not import); each is reported as its own test.
Cost: ~16 CPU-s, most of it the world interpreter's imports.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from tests.helpers.apex_adam_checks import CHECKS as ADAM_CHECKS
from tests.helpers.worlds import drive_in_world

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def raises(fn, *args, match: str) -> None:
    try:
        fn(*args)
    except (RuntimeError, ValueError, TypeError, AssertionError) as e:
        assert match in str(e), f"{match!r} not in {e!r}"
        return
    raise AssertionError(f"no error (expected {match!r})")


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@check
def megatron_takes_its_apex_branches():
    """megatron-core's imports pick Apex's classes (optimizer/__init__.py lines 19-23,
    distrib_optimizer.py 27-31, clip_grads.py 22-28, optimizer.py 22-26, transformer_block.py 58-59,
    fusions/fused_layer_norm.py 15-27, tensor_parallel/layers.py 49-53), and `import apex` loads
    optimizers and normalization but no CUDA extension yet (apex/__init__.py lines 14-15;
    fused_layer_norm.py lines 41-43 imports its extension at the first forward)."""
    import sys

    import amp_C
    import apex
    from megatron.core.fusions import fused_layer_norm as mfln
    from megatron.core.optimizer import SGD, Adam, clip_grads, distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import transformer_block

    assert Adam is apex.optimizers.FusedAdam and SGD is apex.optimizers.FusedSGD
    assert distrib_optimizer.USING_APEX_OPTIMIZER and distrib_optimizer.HAVE_APEX_OR_TE
    assert (clip_grads.l2_norm_impl is amp_C.multi_tensor_l2norm
            and optimizer.multi_tensor_scale_impl is amp_C.multi_tensor_scale)
    assert transformer_block.LayerNormImpl is mfln.FusedLayerNorm
    assert mfln.HAVE_PERSIST_LAYER_NORM and mfln.HAVE_FUSED_LAYER_NORM and layers._grad_accum_fusion_available
    assert "fused_layer_norm_cuda" not in sys.modules and "apex.contrib" in sys.modules  # contrib: megatron's import


@check
def multi_tensor_applier_hands_apex_chunk_size_first():
    """apex/multi_tensor_apply/__init__.py line 3 (2048 * 32), multi_tensor_apply.py lines 6-13, 24-27."""
    from apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

    assert MultiTensorApply.available and multi_tensor_applier.chunk_size == 65536
    seen = []
    assert multi_tensor_applier(lambda *a: seen.append(a) or 7, "flag", [["t"]], 1.5, True) == 7
    assert seen == [(65536, "flag", [["t"]], 1.5, True)]


@check
def multi_tensor_scale_scales_in_float32_and_flags_non_finite():
    """csrc/multi_tensor_scale_kernel.cu lines 60-61 (float product), 92 (flag, still written), 96-107
    (the out list's dtype); csrc/multi_tensor_apply.cuh lines 35-51 (the checks)."""
    import amp_C
    import numpy as np

    flag = torch.zeros(1, dtype=torch.int32)
    src = [rand(7, 3, seed=1), rand(5, seed=2)]
    dst = [torch.empty(7, 3, dtype=torch.bfloat16), torch.empty(5, dtype=torch.bfloat16)]
    amp_C.multi_tensor_scale(2048, flag, [src, dst], 1 / 3)
    for s, d in zip(src, dst):
        want = torch.from_numpy(s.numpy() * np.float32(1 / 3)).to(torch.bfloat16)  # float32 x float32
        assert torch.equal(d, want)
    assert flag.item() == 0
    amp_C.multi_tensor_scale(2048, flag, [[torch.tensor([1.0, float("inf")])], [out := torch.zeros(2)]], 2.0)
    assert flag.item() == 1 and out.tolist() == [2.0, float("inf")]
    raises(amp_C.multi_tensor_scale, 2048, flag, [src, dst[:1]], 1.0, match="Size mismatch among tensor lists")
    raises(amp_C.multi_tensor_scale, 2048, flag, [[], []], 1.0, match="tensor_lists[0].size() is not > 0")
    raises(amp_C.multi_tensor_scale, 2048, flag, [[rand(4, 4).t()], [torch.empty(4, 4)]], 1.0, match="not contiguous")
    raises(amp_C.multi_tensor_scale, 2048, flag.long(), [src, src], 1.0, match="expected scalar type Int")
    raises(amp_C.multi_tensor_scale, 2048, None, [src, src], 1.0, match="incompatible function arguments")


@check
def multi_tensor_l2norm_returns_the_float32_norm_and_per_tensor_norms():
    """csrc/multi_tensor_l2norm_kernel.cu lines 290-335: ([1] total, [n] or [0] per tensor), float32,
    squares summed in float32 whatever the input dtype; flag on a non-finite sum (line 85)."""
    import amp_C

    flag = torch.zeros(1, dtype=torch.int32)
    ts = [rand(10, 4, seed=3), rand(3, seed=4), rand(6, seed=5)]
    total, per = amp_C.multi_tensor_l2norm(2048, flag, [ts], False)
    want = sum(float(t.double().square().sum()) for t in ts) ** 0.5
    assert total.dtype == torch.float32 and total.shape == (1,) and per.shape == (0,)
    assert abs(total.item() - want) <= 1e-6 * want and flag.item() == 0
    _, per = amp_C.multi_tensor_l2norm(2048, flag, [ts], True)
    torch.testing.assert_close(per.double(), torch.stack([t.double().norm() for t in ts]), rtol=1e-6, atol=0)
    bf = [t.to(torch.bfloat16) for t in ts]
    total, _ = amp_C.multi_tensor_l2norm(2048, flag, [bf], False)
    assert (total.dtype == torch.float32
            and abs(total.item() - sum(float(t.double().square().sum()) for t in bf) ** 0.5) < 1e-5)
    amp_C.multi_tensor_l2norm(2048, flag, [[torch.tensor([float("nan")])]], False)
    assert flag.item() == 1
    raises(amp_C.multi_tensor_l2norm, 2048, flag, [[ts[0], bf[1]]], False, match="mixed dtypes")


@check
def fused_sgd_steps_as_torch_sgd_and_skips_bfloat16():
    """apex/optimizers/fused_sgd.py with csrc/multi_tensor_sgd_kernel.cu lines 84-109: for float32
    parameters the same update as torch.optim.SGD (momentum starts as the gradient, Nesterov,
    L2 weight decay before momentum); only float16/float32 parameters are stepped (lines 238-261);
    the constructor's checks (lines 89-104); zero_grad (lines 129-135)."""
    from apex.optimizers import FusedSGD

    for kw in (dict(momentum=0.9, nesterov=True, weight_decay=0.01), dict(momentum=0.8, dampening=0.3), dict()):
        ours, ref = [torch.nn.Parameter(rand(6, 5, seed=7)), torch.nn.Parameter(rand(4, seed=8))], []
        ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        opt, ref_opt = FusedSGD(ours, lr=0.1, **kw), torch.optim.SGD(ref, lr=0.1, **kw)
        for step in range(3):
            for i, (p, q) in enumerate(zip(ours, ref)):
                p.grad = rand(*p.shape, seed=100 * step + i)
                q.grad = p.grad.clone()
            opt.step()
            ref_opt.step()
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            if kw.get("momentum"):
                torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"],
                                           rtol=1e-6, atol=1e-7)
    bf = torch.nn.Parameter(rand(3, dtype=torch.bfloat16))
    before = bf.detach().clone()
    bf.grad = torch.ones_like(bf)
    opt = FusedSGD([bf], lr=1.0, momentum=0.9)
    opt.step()
    assert torch.equal(bf.detach(), before) and len(opt.state) == 0
    raises(FusedSGD, [bf], 0.1, 0.9, 0.5, 0, True, match="Nesterov momentum requires a momentum and zero dampening")
    raises(FusedSGD, [bf], -1.0, match="Invalid learning rate")
    FusedSGD([bf], lr=0.1, set_grad_none=True).zero_grad()
    assert bf.grad is None


def _ln_reference(x, w, b, eps):
    """torch's own LayerNorm in float64, and its gradients for a fixed upstream gradient."""
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y = torch.nn.functional.layer_norm(x64, w64.shape, w64, b64, eps)
    dy = rand(*x.shape, seed=9, dtype=torch.float64)
    y.backward(dy)
    return y, dy, (x64.grad, w64.grad, b64.grad)


@check
def fused_layer_norm_affine_function_is_torch_layer_norm():
    """apex/normalization/fused_layer_norm.py lines 38-74 over csrc/layer_norm_cuda.cpp: the forward
    and the gradients of LayerNorm (here against torch's, float64), also with memory_efficient (the
    output saved instead of the input); output in the input's dtype, statistics float32 for bf16
    (lines 99-105); the checks (lines 30-54, 94-96, the kernel's dtype dispatch at line 833)."""
    import fused_layer_norm_cuda
    from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction as F

    x, w, b = rand(3, 4, 8, seed=10), 1 + rand(8, seed=11), rand(8, seed=12)
    y_ref, dy, grads_ref = _ln_reference(x, w, b, 1e-5)
    for efficient in (False, True):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = F.apply(xs, ws, bs, torch.Size([8]), 1e-5, efficient)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y.double(), y_ref, rtol=1e-6, atol=1e-6)
        y.backward(dy.float())  # the backward has no float64 kernel (layer_norm_cuda_kernel.cu line 953)
        for got, want in zip((xs.grad, ws.grad, bs.grad), grads_ref):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    x64 = x.double()
    torch.testing.assert_close(F.apply(x64, w.double(), b.double(), torch.Size([8]), 1e-5), y_ref, rtol=1e-12,
                               atol=1e-12)
    xb, wb, bb = x.to(torch.bfloat16), w.to(torch.bfloat16), b.to(torch.bfloat16)
    out, mean, invvar = fused_layer_norm_cuda.forward_affine(xb, [8], wb, bb, 1e-5)
    assert out.dtype == torch.bfloat16 and mean.dtype == invvar.dtype == torch.float32 and mean.shape == (12,)
    raises(fused_layer_norm_cuda.forward_affine, xb, [8], w.float(), b.float(), 1e-5, match="expected scalar type")
    raises(fused_layer_norm_cuda.forward_affine, x, [4], w, b, 1e-5, match="Given normalized_shape=[4], expected input")
    raises(fused_layer_norm_cuda.forward_affine, x.transpose(0, 1), [8], w, b, 1e-5, match="input must be contiguous")
    raises(fused_layer_norm_cuda.backward_affine, x64, mean.double(), invvar.double(), x64, [8], w.double(), b.double(),
           1e-5, False, match="not implemented for 'torch.float64'")


@check
def megatron_fused_layer_norm_runs_on_apex_and_refuses_rms_norm():
    """megatron-core's FusedLayerNorm (fusions/fused_layer_norm.py, the Apex world's default norm):
    LayerNorm through FusedLayerNormAffineFunction, or FastLayerNormFN when persist_layer_norm and
    the hidden size has a persistent kernel (its list, and Apex's REGISTER_FWD_LAUNCHER sizes);
    its assertion on any other normalization, which an RMSNorm family meets (issue 43 defect 2)."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer import TransformerConfig

    for hidden, persist in ((32, False), (1024, True)):
        cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, normalization="LayerNorm",
                                persist_layer_norm=persist)
        norm = FusedLayerNorm(cfg, hidden, eps=1e-5)
        assert norm.persist_layer_norm == persist
        with torch.no_grad():
            norm.weight.copy_(1 + rand(hidden, seed=13))
            norm.bias.copy_(rand(hidden, seed=14))
        x = rand(5, 2, hidden, seed=15)
        want = torch.nn.functional.layer_norm(x.double(), (hidden,), norm.weight.double(), norm.bias.double(), 1e-5)
        torch.testing.assert_close(norm(x).double(), want, rtol=1e-5, atol=1e-5)
    rms = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, normalization="RMSNorm")
    raises(FusedLayerNorm, rms, 32, match="(RMSNorm) is not supported in FusedLayerNorm")


@check
def fast_layer_norm_is_layer_norm_at_registered_sizes_only():
    """apex/contrib/layer_norm/layer_norm.py lines 8-36 over contrib/csrc/layer_norm/ln_api.cpp: LayerNorm
    and its gradients (against torch's), the output a view shaped as the input (megatron makes it
    viewless); the output in the weights' dtype (lines 6-22); only registered hidden sizes (line 65)."""
    from apex.contrib.layer_norm.layer_norm import FastLayerNormFN

    x, w, b = rand(3, 2, 768, seed=16), 1 + rand(768, seed=17), rand(768, seed=18)
    y_ref, dy, grads_ref = _ln_reference(x, w, b, 1e-5)
    for efficient in (False, True):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = FastLayerNormFN.apply(xs, ws, bs, 1e-5, efficient)
        assert y.shape == x.shape and y._base is not None
        torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
        y.backward(dy.float())
        for got, want in zip((xs.grad, ws.grad, bs.grad), grads_ref):
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert FastLayerNormFN.apply(x, w.bfloat16(), b.bfloat16(), 1e-5).dtype == torch.bfloat16
    raises(FastLayerNormFN.apply, rand(4, 32), rand(32), rand(32), 1e-5, match="FWD: Unsupported hidden_size or types")


@check
def softmax_kernels_block_sizes_and_checks():
    """csrc/megatron/scaled_masked_softmax.h lines 421-433 (get_batch_per_block, 32-thread warps);
    the extensions' checks (scaled_upper_triang_masked_softmax.cpp lines 31-33, scaled_masked_softmax.cpp
    33-36); the causal backward works in place (scaled_upper_triang_masked_softmax_cuda.cu 54-74)."""
    import scaled_masked_softmax_cuda as masked
    import scaled_upper_triang_masked_softmax_cuda as causal

    assert {sk: masked.get_batch_per_block(8, sk, 2, 2) for sk in (16, 17, 32, 128, 129, 4096)} == \
        {16: 16, 17: 8, 32: 8, 128: 8, 129: 4, 4096: 4}
    raises(causal.forward, rand(8, 16, 16), 1.0, match="Only fp16 and bf16 are supported")
    raises(causal.forward, rand(1, 8, 16, 16, dtype=torch.bfloat16), 1.0, match="expected 3D tensor")
    raises(masked.forward, rand(1, 8, 16, 16, dtype=torch.bfloat16), torch.zeros(1, 8, 16, 16, dtype=torch.bool), 1.0,
           match="mask.size(1) == 1")
    g = rand(16, 16, 16, dtype=torch.bfloat16)
    assert causal.backward(g, causal.forward(g, 1.0), 1.0).data_ptr() == g.data_ptr()


@check
def megatron_fused_softmax_runs_on_apex_kernels():
    """megatron-core's FusedScaleMaskSoftmax (fusions/fused_softmax.py) with masked_softmax_fusion on a
    bfloat16 input takes the kernels (is_kernel_available). Against a float32 reference: the forward
    scale rounded to bfloat16 first (scaled_upper_triang_masked_softmax.h line 335, `const input_t
    scale`), the backward's not (`const acc_t scale`, line 448); masked entries -10000 and a fully
    masked row zeros (scaled_masked_softmax.h lines 269, 297); the three kernels megatron calls."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    b, heads, s, scale = 2, 4, 32, 0.3  # b * heads a multiple of the 8 batches per block at s = 32
    x = (rand(b, heads, s, s, seed=19) * 5).to(torch.bfloat16)
    padding = torch.zeros(b, 1, s, s, dtype=torch.bool)
    padding[0, 0, :, s // 2:] = True
    padding[1, 0, 3, :] = True  # a fully masked row
    no_mask = torch.zeros(s, s, dtype=torch.bool)
    # causal: scaled_upper_triang_masked_softmax_cuda; padding with a mask: scaled_masked_softmax_cuda;
    # padding without one: scaled_softmax_cuda (fused_softmax.py forward_fused_softmax).
    for kind, mask in ((AttnMaskType.causal, None), (AttnMaskType.padding, padding), (AttnMaskType.padding, None)):
        fused = FusedScaleMaskSoftmax(False, True, kind, True, attention_mask_func, True, scale)
        assert fused.is_kernel_available(mask, b, heads, s, s)
        xs = x.clone().requires_grad_()
        y = fused(xs, mask)
        logits = x.float() * float(torch.tensor(scale).bfloat16())
        causal = kind == AttnMaskType.causal
        banned = torch.ones(s, s, dtype=torch.bool).triu(1) if causal else (no_mask if mask is None else mask)
        ref = torch.softmax(logits.masked_fill(banned, float("-inf") if causal else -10000.0), dim=-1)
        if mask is not None:
            ref[1, :, 3, :] = 0.0
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), ref, rtol=0, atol=4e-3)
        # The rounding of the scale is visible in the bfloat16 outputs: nearly every one is the
        # rounded-scale reference's, a third differ from the unrounded one's.
        unrounded = torch.softmax((x.float() * scale).masked_fill(banned, -1e4), dim=-1)
        if mask is not None:
            unrounded[1, :, 3, :] = 0.0
        assert (y != ref.bfloat16()).float().mean() < 0.01 < 0.1 < (y != unrounded.bfloat16()).float().mean()
        dy = rand(*x.shape, seed=20, dtype=torch.bfloat16)
        yf, gf = y.detach().float(), dy.float()
        y.backward(dy)  # the causal kernel's backward overwrites dy (works in place, see above)
        want = scale * yf * (gf - (gf * yf).sum(-1, keepdim=True))
        torch.testing.assert_close(xs.grad.float(), want, rtol=0, atol=2e-2 * want.abs().max().item())


@check
def megatron_linear_accumulates_its_weight_gradient_through_apex():
    """csrc/megatron/fused_weight_gradient_dense_cuda.cu lines 58-83 and
    fused_weight_gradient_dense_16bit_prec_cuda.cu 49-74: main_grad += d_output^T @ input, float32
    main_grad for any input dtype, a 16-bit one only with that dtype; megatron's ColumnParallelLinear
    builds with gradient_accumulation_fusion (tensor_parallel/layers.py line 1070) and accumulates
    into weight.main_grad in its backward (line 680)."""
    import fused_weight_gradient_mlp_cuda as wgrad
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig

    from vapo_megatron.mcore import parallel

    parallel.init_distributed(1, 1)
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                            gradient_accumulation_fusion=True)
    layer = tensor_parallel.ColumnParallelLinear(8, 6, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                                                 gather_output=False)
    start = rand(6, 8, seed=21)
    layer.weight.main_grad = start.clone()
    x = rand(5, 2, 8, seed=22).requires_grad_()
    out, _ = layer(x)
    dy = rand(*out.shape, seed=23)
    out.backward(dy)
    want = start.double() + dy.double().reshape(-1, 6).t() @ x.detach().double().reshape(-1, 8)
    torch.testing.assert_close(layer.weight.main_grad.double(), want, rtol=1e-6, atol=1e-6)
    acc = torch.zeros(6, 8, dtype=torch.bfloat16)
    wgrad.wgrad_gemm_accum_fp16(x.detach().bfloat16(), dy.bfloat16(), acc)
    torch.testing.assert_close(acc.float(), (want - start.double()).float(), rtol=2e-2, atol=5e-2)
    raises(wgrad.wgrad_gemm_accum_fp16, x.detach().bfloat16(), dy.bfloat16(), torch.zeros(6, 8),
           match="expected scalar type")
    raises(wgrad.wgrad_gemm_accum_fp32, x.detach(), dy.bfloat16(), torch.zeros(6, 8), match="expected scalar type")


CHECKS.update(ADAM_CHECKS)  # FusedAdam's, one behaviour each (tests/helpers/apex_adam_checks.py)


def run_checks(names: list[str]) -> dict[str, str]:
    """In the Apex world: each check's "ok" or its traceback."""
    out = {}
    for name in names:
        try:
            CHECKS[name]()
            out[name] = "ok"
        except BaseException:  # noqa: BLE001 - reported per check to the parent
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def apex_world() -> dict[str, str]:
    return drive_in_world("apex", run_checks, list(CHECKS))


@pytest.mark.parametrize("name", list(CHECKS))
def test_apex_double(apex_world, name):
    assert apex_world[name] == "ok", apex_world[name]
