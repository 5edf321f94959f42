"""What tests/unit/test_te_doubles.py checks, run on two gloo ranks of the TE world (the stand-ins
in tests/doubles/te are importable only there). Each check compares a stand-in with plain torch
(or torch's own optimizers) and with what the cited Transformer Engine 2.20 source does; `run`
returns {check: None, or the traceback of its failure} so that each one is reported on its own.

File references are to NVIDIA/TransformerEngine, transformer_engine/pytorch/ unless stated."""

from __future__ import annotations

import traceback

import torch
import torch.nn.functional as F

S, B, H = 4, 2, 8  # sequence (divisible by TP=2 for sequence parallelism), batch, hidden


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def close_to(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 1e-5) -> None:
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.allclose(a.float(), b.float(), atol=atol, rtol=0), (what, (a.float() - b.float()).abs().max())


def _tp():
    from vapo_megatron.mcore import parallel

    return parallel.tp_group(), parallel.tp_rank()


def check_package():
    """The world is TE 2.20.2 as megatron-core sees it (megatron/core/utils.py get_te_version)."""
    import transformer_engine
    from megatron.core import utils
    from megatron.core.extensions import transformer_engine as mte
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import Adam, clip_grads
    from megatron.core.transformer import attention
    from transformer_engine.pytorch.optimizers import FusedAdam, multi_tensor_l2norm, multi_tensor_scale_tensor

    assert transformer_engine.__version__ == "2.20.2" and str(utils.get_te_version()) == "2.20.2"
    assert mte.HAVE_TE and Adam is FusedAdam
    assert (clip_grads.l2_norm_impl is multi_tensor_l2norm
            and clip_grads.multi_tensor_scale_tensor_impl is multi_tensor_scale_tensor)
    # attention/__init__.py (2.20) exports neither _SplitAlongDim nor apply_rotary_pos_emb: megatron
    # splits Q/K/V with torch.split and takes RoPE from attention/rope.py.
    assert attention.SplitAlongDim is None and rope_utils.fused_apply_rotary_pos_emb is not None
    assert mte.te_general_gemm is not None  # the MoE router's GEMM (moe_utils.py) goes through TE


def check_linear_parameters():
    """module/linear.py Linear.__init__ (~1580-1800) and reset_parameters (~1830)."""
    from transformer_engine.pytorch import Linear

    tp, _ = _tp()
    col = Linear(8, 6, parallel_mode="column", tp_group=tp, params_dtype=torch.bfloat16, device="cpu",
                 init_method=lambda w: torch.nn.init.constant_(w, 0.5))
    assert [(n, tuple(p.shape), p.dtype) for n, p in col.named_parameters()] == [
        ("weight", (3, 8), torch.bfloat16), ("bias", (3,), torch.bfloat16)]
    assert (col.weight == 0.5).all() and (col.bias == 0).all() and col.weight.device.type == "cpu"
    assert (col.weight.tensor_model_parallel, col.weight.partition_dim, col.weight.partition_stride) == (True, 0, 1)
    assert (col.bias.tensor_model_parallel, col.bias.partition_dim) == (True, 0)
    sd = col.state_dict()
    assert list(sd) == ["weight", "bias", "_extra_state"]
    assert sd["_extra_state"].dtype == torch.uint8 and sd["_extra_state"].numel() == 0  # base.py ~1390
    row = Linear(8, 6, parallel_mode="row", tp_group=tp, bias=True, sequence_parallel=True, device="cpu")
    assert tuple(row.weight.shape) == (6, 4) and row.weight.partition_dim == 1 and row.weight.dtype == torch.float32
    assert row.bias.sequence_parallel is True and not hasattr(row.bias, "tensor_model_parallel")
    plain = Linear(8, 6, bias=False, device="cpu")
    assert [n for n, _ in plain.named_parameters()] == ["weight"] and plain.weight.tensor_model_parallel
    assert isinstance(plain.bias, torch.Tensor) and plain.bias.numel() == 0 and "bias" not in plain.state_dict()
    calls = []
    meta = Linear(8, 6, device="meta", init_method=calls.append)  # reset_parameters(defer_init=True)
    assert meta.weight.device.type == "meta" and not calls

    class Tracker:  # base.py reset_parameters: init under get_rng_state_tracker().fork(rng_tracker_name)
        forks = []

        def fork(self, name="model-parallel-rng"):
            import contextlib
            Tracker.forks.append(name)
            return contextlib.nullcontext()

    Linear(8, 6, device="cpu", get_rng_state_tracker=Tracker, rng_tracker_name="expert-rng")
    Linear(8, 6, device="cpu", get_rng_state_tracker=Tracker)
    assert Tracker.forks == ["expert-rng", "model-parallel-rng"]


def _pair(sp: bool, seed: int, return_bias: bool = False):
    """A column- and a row-parallel Linear at TP=2 holding this rank's shards of a full MLP."""
    from transformer_engine.pytorch import Linear

    tp, r = _tp()
    w1, b1, w2, b2 = rand(6, H, seed=seed), rand(6, seed=seed + 1), rand(H, 6, seed=seed + 2), rand(H, seed=seed + 3)
    col = Linear(H, 6, parallel_mode="column", tp_group=tp, sequence_parallel=sp, device="cpu")
    row = Linear(6, H, parallel_mode="row", tp_group=tp, sequence_parallel=sp, device="cpu", return_bias=return_bias)
    with torch.no_grad():
        col.weight.copy_(w1.chunk(2)[r]), col.bias.copy_(b1.chunk(2)[r])
        row.weight.copy_(w2.chunk(2, dim=1)[r]), row.bias.copy_(b2)
    return col, row, (w1, b1, w2, b2), r


def check_linear_tp_math():
    """Column + row parallel at TP=2, with and without sequence parallelism, equal one full MLP
    (module/linear.py _Linear forward/backward: SP all-gathers the input and reduce-scatters dgrad;
    row parallel reduces its output, its bias added after the reduction)."""
    for sp in (False, True):
        col, row, (w1, b1, w2, b2), r = _pair(sp, seed=10)
        x_full = rand(S, B, H, seed=20).requires_grad_(True)
        g_full = rand(S, B, H, seed=21)
        ref = F.gelu(x_full @ w1.T + b1) @ w2.T + b2
        (ref * g_full).sum().backward()
        x = (x_full.detach().chunk(2)[r] if sp else x_full.detach()).clone().requires_grad_(True)
        y = row(F.gelu(col(x)))
        want = ref.detach().chunk(2)[r] if sp else ref.detach()
        close_to(y, want, f"output sp={sp}")
        (y * (g_full.chunk(2)[r] if sp else g_full)).sum().backward()
        close_to(x.grad, x_full.grad.chunk(2)[r] if sp else x_full.grad, f"dgrad sp={sp}")
        w1_full, w2_full = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        ((F.gelu(x_full.detach() @ w1_full.T + b1) @ w2_full.T + b2) * g_full).sum().backward()
        close_to(col.weight.grad, w1_full.grad.chunk(2)[r], f"column wgrad sp={sp}")
        close_to(row.weight.grad, w2_full.grad.chunk(2, dim=1)[r], f"row wgrad sp={sp}")
    col, row, (w1, b1, w2, b2), r = _pair(False, seed=30, return_bias=True)  # (out without bias, bias)
    out, bias = row(F.gelu(col(rand(S, B, H, seed=31))))
    close_to(out + bias, F.gelu(rand(S, B, H, seed=31) @ w1.T + b1) @ w2.T + b2, "return_bias")
    try:
        col(rand(S, B, H, seed=32, dtype=torch.bfloat16))
    except TypeError as e:  # base.py prepare_forward: dtypes must match outside autocast
        assert "Data types for parameters must match" in str(e)
    else:
        raise AssertionError("a bfloat16 input to a float32 Linear was accepted")


def check_layernorm_linear():
    """module/layernorm_linear.py LayerNormLinear: parameter order and init (~1450), the norm on
    this rank's tokens then the gathered GEMM (forward), row parallel refused (~1370)."""
    from transformer_engine.pytorch import LayerNormLinear

    tp, r = _tp()
    rms = LayerNormLinear(H, 6, normalization="RMSNorm", parallel_mode="column", tp_group=tp, bias=False,
                          sequence_parallel=True, eps=1e-6, device="cpu")
    assert [n for n, _ in rms.named_parameters()] == ["layer_norm_weight", "weight"] and rms.layer_norm_bias is None
    assert (rms.layer_norm_weight == 1).all() and rms.layer_norm_weight.sequence_parallel is True
    assert list(rms.state_dict()) == ["layer_norm_weight", "weight", "_extra_state"]
    ln = LayerNormLinear(H, 6, normalization="LayerNorm", zero_centered_gamma=True, device="cpu")
    assert [n for n, _ in ln.named_parameters()] == ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]
    assert (ln.layer_norm_weight == 0).all() and (ln.layer_norm_bias == 0).all()
    gamma, w = rand(H, seed=40), rand(6, H, seed=41)
    with torch.no_grad():
        rms.layer_norm_weight.copy_(gamma), rms.weight.copy_(w.chunk(2)[r])
        ln.layer_norm_weight.copy_(gamma), ln.layer_norm_bias.copy_(rand(H, seed=42)), ln.weight.copy_(w)
    x = rand(S, B, H, seed=43)
    want = F.rms_norm(x, (H,), gamma, eps=1e-6) @ w.T
    close_to(rms(x.chunk(2)[r]), want[..., r * 3:(r + 1) * 3], "RMSNorm + column GEMM under SP")
    want = F.layer_norm(x, (H,), 1 + gamma, rand(H, seed=42), eps=1e-5) @ w.T + ln.bias
    close_to(ln(x), want, "zero-centered LayerNorm + GEMM")
    try:
        LayerNormLinear(H, 6, parallel_mode="row", device="cpu")
    except NotImplementedError as e:
        assert "Normalization does not support tensor-parallel distribution" in str(e)
    else:
        raise AssertionError("a row-parallel LayerNormLinear was built")


def check_norms():
    """module/rmsnorm.py, layernorm.py over ops/basic/rmsnorm.py, layer_norm.py: init 1 (0
    zero-centered), `sequence_parallel` copied onto the parameters, computed in the weight's dtype."""
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.transformer import TransformerConfig
    from transformer_engine.pytorch import LayerNorm, RMSNorm

    rms = RMSNorm(H, eps=1e-6, sequence_parallel=True, params_dtype=torch.bfloat16, device="cpu")
    assert [(n, p.dtype) for n, p in rms.named_parameters()] == [("weight", torch.bfloat16)]
    assert (rms.weight == 1).all() and rms.weight.sequence_parallel is True
    assert list(rms.state_dict()) == ["weight", "_extra_state"] and rms.state_dict()["_extra_state"].numel() == 0
    x = rand(S, B, H, seed=50)
    close_to(rms(x), F.rms_norm(x.bfloat16().float(), (H,), eps=1e-6).bfloat16(), "bf16 RMSNorm", atol=1e-2)
    assert rms(x).dtype == torch.bfloat16  # the input is cast to the weight's dtype
    zc = RMSNorm(H, zero_centered_gamma=True, device="cpu")
    assert (zc.weight == 0).all()
    with torch.no_grad():
        zc.weight.copy_(rand(H, seed=51))
    close_to(zc(x), F.rms_norm(x, (H,), 1 + rand(H, seed=51), eps=1e-5), "zero-centered RMSNorm")
    ln = LayerNorm(H, sequence_parallel=False, device="cpu")
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"] and ln.bias.sequence_parallel is False
    close_to(ln(x), F.layer_norm(x, (H,), eps=1e-5), "LayerNorm")
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, normalization="RMSNorm",
                            use_cpu_initialization=True)
    assert type(TENorm(cfg, H)) is RMSNorm  # megatron's TENorm builds TE's RMSNorm from the config


def check_attention():
    """attention/dot_product_attention/dot_product_attention.py DotProductAttention: sbhd in,
    [s, b, h * d] out, GQA, causal from the top left, no parameters but an _extra_state."""
    from transformer_engine.pytorch import DotProductAttention

    tp, _ = _tp()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, attn_mask_type="causal")
    assert not list(dpa.parameters()) and list(dpa.state_dict()) == ["_extra_state"]
    q, k, v = rand(5, B, 4, 8, seed=60), rand(5, B, 2, 8, seed=61), rand(5, B, 2, 8, seed=62)
    out = dpa(q, k, v, None, attn_mask_type="causal")
    want = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=True)
    close_to(out, want.permute(2, 0, 1, 3).reshape(5, B, 32), "causal GQA attention")
    assert abs(dpa.softmax_scale - 8 ** -0.5) < 1e-12  # ~756: 1 / sqrt(kv_channels)
    sharded = DotProductAttention(4, 8, num_gqa_groups=2, tp_group=tp)  # 1 group per rank at TP=2
    try:
        sharded(q[:, :, :2], k, v, None)
    except AssertionError as e:
        assert "num_gqa_group = 1" in str(e)
    else:
        raise AssertionError("K/V with the unsplit groups were accepted at TP=2")
    drop = DotProductAttention(4, 8, attention_dropout=0.1)
    try:
        drop(q, q, q, None)
    except NotImplementedError:
        pass
    else:
        raise AssertionError("attention dropout ran unmodelled")


def check_grouped_linear():
    """module/grouped_linear.py GroupedLinear: weight{i} (bias{i}) per GEMM (~1740), rows split by
    m_splits (~2195), bias refused at TP > 1."""
    from transformer_engine.pytorch import GroupedLinear

    tp, _ = _tp()
    g = GroupedLinear(3, H, 6, bias=True, device="cpu")
    assert [n for n, _ in g.named_parameters()] == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
    assert all(getattr(g, f"weight{i}").tensor_model_parallel for i in range(3))
    nb = GroupedLinear(3, H, 6, bias=False, device="cpu", params_dtype=torch.bfloat16)
    assert list(nb.state_dict()) == ["weight0", "weight1", "weight2", "_extra_state"] and nb.bias0.numel() == 0
    ws = [rand(6, H, seed=70 + i) for i in range(3)]
    with torch.no_grad():
        for i, w in enumerate(ws):
            getattr(g, f"weight{i}").copy_(w)
            getattr(g, f"bias{i}").fill_(i)
    x = rand(5, H, seed=73)
    want = torch.cat([part @ w.T + i for i, (part, w) in enumerate(zip(x.split([2, 0, 3]), ws))])
    close_to(g(x, [2, 0, 3]), want, "grouped GEMM")
    for bad in (lambda: g(x, [5, 0]), lambda: GroupedLinear(2, H, 6, bias=True, tp_group=tp, device="cpu")):
        try:
            bad()
        except ValueError:
            continue
        raise AssertionError("a wrong m_splits or a bias at TP=2 was accepted")


def check_extra_state():
    """base.py set_extra_state (~1419): None and empty tensors load nothing; a strict load of a
    state_dict with `_extra_state` works; FP8 metadata (non-empty) is not modelled."""
    from transformer_engine.pytorch import Linear

    a, b = Linear(H, 6, device="cpu"), Linear(H, 6, device="cpu")
    b.load_state_dict(a.state_dict(), strict=True)
    assert torch.equal(a.weight, b.weight)
    b.set_extra_state(None)
    try:
        b.set_extra_state(torch.ones(3, dtype=torch.uint8))
    except NotImplementedError:
        return
    raise AssertionError("FP8 extra state was accepted")


def run(names: list[str]) -> dict:
    from tests.helpers import te_kernel_checks
    from vapo_megatron.mcore import parallel

    parallel.init_distributed(2, 1)
    out = {}
    for name in names:
        check = globals().get(f"check_{name}") or getattr(te_kernel_checks, f"check_{name}")
        try:
            check()
            out[name] = None
        except BaseException:  # noqa: BLE001 - every failure is reported with its check
            out[name] = traceback.format_exc()
    return out
