"""The second half of tests/unit/test_te_doubles.py's checks (te_double_checks.py runs them): TE's
kernels and optimizers as megatron-core calls them, the unmodelled paths, and what state_dict()
and megatron's sharded_state_dict() of a TE-spec model hold. References: plain torch and torch's
own optimizers; file references are to NVIDIA/TransformerEngine, transformer_engine/pytorch/."""

from __future__ import annotations

import contextlib

import torch

from tests.helpers.te_double_checks import B, H, S, close_to, rand


def _raises(exc, fn, what: str) -> None:
    try:
        fn()
    except exc:
        return
    raise AssertionError(f"{what} did not raise {exc.__name__}")


def check_multi_tensor():
    """optimizers/multi_tensor_apply.py (empty slots dropped, None when nothing is left, aligned
    lists); csrc/extensions/multi_tensor/l2norm.cpp ((norm [1], per-tensor or empty) in float32);
    common/multi_tensor/scale.cu (in float32, a non-finite input sets the flag)."""
    from transformer_engine.pytorch.optimizers import (
        multi_tensor_applier,
        multi_tensor_l2norm,
        multi_tensor_scale,
        multi_tensor_scale_tensor,
    )

    seen = []
    a, b = rand(3, seed=1), rand(2, 2, seed=2)
    multi_tensor_applier(lambda chunk, flag, lists: seen.append((chunk, lists)), None,
                         [[a, torch.empty(0), b], [a, torch.empty(0), b]])
    assert seen[0][0] == 2048 * 32 and [len(x) for x in seen[0][1]] == [2, 2]
    assert multi_tensor_applier(multi_tensor_scale, None, [[torch.empty(0)], [torch.empty(0)]], 2.0) is None
    _raises(RuntimeError, lambda: multi_tensor_applier(multi_tensor_scale, None, [[a], []], 2.0), "misaligned lists")
    flag = torch.zeros(1, dtype=torch.int)
    norm, per = multi_tensor_applier(multi_tensor_l2norm, flag, [[a, b.bfloat16()]], False)
    assert norm.dtype == torch.float32 and norm.shape == (1,) and per.numel() == 0
    close_to(norm[0], torch.linalg.vector_norm(torch.cat([a, b.bfloat16().float().flatten()])), "l2norm")
    _, per = multi_tensor_applier(multi_tensor_l2norm, flag, [[a, b]], True)
    close_to(per, torch.stack([a.norm(), b.norm()]), "per-tensor norms")
    dst = torch.empty(3, dtype=torch.bfloat16)
    multi_tensor_applier(multi_tensor_scale, flag, [[a], [dst]], 0.5)
    assert torch.equal(dst, (a * 0.5).bfloat16()) and flag.item() == 0
    bad = torch.tensor([1.0, float("inf")])
    out = torch.empty(2)
    multi_tensor_applier(multi_tensor_scale_tensor, flag, [[bad], [out]], torch.tensor([3.0]))
    assert flag.item() == 1 and out[0].item() == 3.0  # written anyway, flagged


def check_fused_sgd():
    """optimizers/fused_sgd.py with common/multi_tensor/sgd.cu: momentum initialized to the first
    gradient, weight decay before momentum: torch.optim.SGD's update; other dtypes than fp16/fp32
    are left alone."""
    from transformer_engine.pytorch.optimizers import FusedSGD

    p, q, odd = rand(4, seed=10), rand(4, seed=10), rand(4, seed=11).bfloat16()
    p, q, odd = (torch.nn.Parameter(t) for t in (p, q, odd))
    ours = FusedSGD([p, odd], lr=0.1, momentum=0.9, weight_decay=0.05)
    ref = torch.optim.SGD([q], lr=0.1, momentum=0.9, weight_decay=0.05)
    before = odd.detach().clone()
    for step in range(3):
        g = rand(4, seed=20 + step)
        p.grad, q.grad, odd.grad = g.clone(), g.clone(), g.bfloat16()
        ours.step(), ref.step()
    close_to(p, q, "FusedSGD vs torch.optim.SGD", atol=1e-6)
    assert set(ours.state[p]) == {"momentum_buffer"} and torch.equal(odd.detach(), before)
    ours.zero_grad()
    assert p.grad is None


def check_fused_adam():
    """optimizers/fused_adam.py (the lead's double): the step count in the group, float32 moments
    per parameter, zero moments for a parameter without a gradient in a stepped group; the update
    is torch.optim.AdamW's."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    p, q, idle = (torch.nn.Parameter(t) for t in (rand(5, seed=30), rand(5, seed=30), rand(2, seed=31)))
    ours = FusedAdam([p, idle], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW([q], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(2):
        g = rand(5, seed=40 + step)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step(), ref.step()
    close_to(p, q, "FusedAdam vs torch.optim.AdamW", atol=1e-6)
    assert ours.param_groups[0]["step"] == 2 and set(ours.state[p]) == {"exp_avg", "exp_avg_sq"}
    assert ours.state[p]["exp_avg"].dtype == torch.float32 and not ours.state[idle]["exp_avg"].any()


def check_fused_adam_counts_an_empty_group():
    """optimizers/fused_adam.py step, lines 560-586 (release_v2.19 and main, TE PR #3318): every
    group's step count advances, an empty one's too, before the empty group is skipped; so a group
    empty on one DP rank keeps the count of the ranks where it is not."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    p = torch.nn.Parameter(rand(3, seed=32))
    ours = FusedAdam([{"params": [p]}, {"params": []}], lr=0.01)
    for step in range(3):
        p.grad = rand(3, seed=33 + step)
        ours.step()
    assert [g["step"] for g in ours.param_groups] == [3, 3]


def check_fused_adam_zero_grad():
    """optimizers/fused_adam.py zero_grad, lines 231-262: set_to_none defaults to True; False is
    torch's zeroing; the deprecated set_grad_none of the constructor (222-229: a DeprecationWarning)
    decides instead, and a zero_grad that contradicts it raises ValueError."""
    import warnings

    from transformer_engine.pytorch.optimizers import FusedAdam

    p = torch.nn.Parameter(rand(3, seed=34))
    opt = FusedAdam([p])
    p.grad = torch.ones(3)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(p.grad, torch.zeros(3))
    opt.zero_grad()
    assert p.grad is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = FusedAdam([p], set_grad_none=False)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    p.grad = torch.ones(3)
    kept.zero_grad()
    assert torch.equal(p.grad, torch.zeros(3))
    _raises(ValueError, lambda: kept.zero_grad(set_to_none=True), "zero_grad against set_grad_none")


def check_wgrad_fusion():
    """fuse_wgrad_accumulation in Linear, LayerNormLinear and GroupedLinear (module/linear.py
    _linear_backward lines 1226-1266, 1354-1376; layernorm_linear.py 1012-1040, 1169-1183;
    grouped_linear.py 1152-1157, 1203-1246): the weight gradient dy^T x is ADDED to the weight's
    main_grad (written over it for the first micro-batch, or with overwrite_main_grad); a weight
    with megatron DDP's `grad_added_to_main_grad` gets it set and a dummy gradient (zeros with
    `zero_out_wgrad`), one without gets None; biases and norm weights get their gradients as
    usual. Unfused, the weight gets its gradient and main_grad is left alone. Reference: the
    gradient autograd computes for F.linear."""
    import torch.nn.functional as F
    import transformer_engine.pytorch as te

    x, dy = rand(S, B, H, seed=80), rand(S, B, 6, seed=81)

    def reference(layer, weight="weight", norm=False):
        w = getattr(layer, weight).detach().clone().requires_grad_()
        inp = x
        if norm:
            inp = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.layer_norm_weight.detach()
        F.linear(inp, w).backward(dy)
        return w.grad

    def run(layer, *, first, ddp=True, zero=False, overwrite=False, weight="weight", **fwd):
        p = getattr(layer, weight)
        start = rand(*p.shape, seed=82)
        p.main_grad, p.grad = start.clone(), None
        if ddp:
            p.grad_added_to_main_grad = False
        if zero:
            p.zero_out_wgrad = True
        if overwrite:
            p.overwrite_main_grad = True
        layer(x, is_first_microbatch=first, **fwd).backward(dy)
        return start, p

    for make, norm in ((lambda: te.Linear(H, 6, bias=True, device="cpu", fuse_wgrad_accumulation=True), False),
                       (lambda: te.LayerNormLinear(H, 6, bias=False, normalization="RMSNorm", device="cpu",
                                                   fuse_wgrad_accumulation=True), True)):
        layer = make()
        want = reference(layer, norm=norm)
        start, p = run(layer, first=False)
        close_to(p.main_grad, start + want, "accumulated into main_grad")
        assert p.grad_added_to_main_grad and p.grad is not None and p.grad.shape == p.shape  # TE's dummy
        if norm:
            assert layer.layer_norm_weight.grad is not None and layer.layer_norm_weight.grad.abs().sum() > 0
        else:
            close_to(layer.bias.grad, dy.reshape(-1, 6).sum(0), "bias gradient")
        _, p = run(layer, first=True)
        close_to(p.main_grad, want, "written over main_grad at the first micro-batch")
        _, p = run(layer, first=False, zero=True)
        assert torch.equal(p.grad, torch.zeros_like(p))  # zero_out_wgrad: a zeroed dummy
        _, p = run(make(), first=None, ddp=False)
        assert p.grad is None and not hasattr(p, "grad_added_to_main_grad")  # no megatron DDP: None
    overwrite = te.Linear(H, 6, bias=False, device="cpu", fuse_wgrad_accumulation=True)
    _, p = run(overwrite, first=False, overwrite=True)
    close_to(p.main_grad, reference(overwrite), "overwrite_main_grad")
    unfused = te.Linear(H, 6, bias=False, device="cpu")
    start, p = run(unfused, first=False)
    assert torch.equal(p.main_grad, start)
    close_to(p.grad, reference(unfused), "unfused weight gradient")
    grouped = te.GroupedLinear(2, H, 6, bias=False, device="cpu", fuse_wgrad_accumulation=True)
    rows = x.reshape(-1, H)
    starts = [rand(6, H, seed=83 + i) for i in range(2)]
    for i in range(2):
        w = getattr(grouped, f"weight{i}")
        w.main_grad, w.grad_added_to_main_grad = starts[i].clone(), False
    grouped(rows, [S * B, 0], is_first_microbatch=False).backward(dy.reshape(-1, 6))
    close_to(grouped.weight0.main_grad, starts[0] + dy.reshape(-1, 6).T @ rows, "expert 0 accumulated")
    assert torch.equal(grouped.weight1.main_grad, starts[1]) and grouped.weight1.grad_added_to_main_grad  # no tokens


def check_general_gemm():
    """cpp_extensions/gemm.py general_gemm (megatron's te_general_gemm for the MoE router):
    D = op(B) @ op(A) for layouts TN, NN, NT, float32 accumulation into out_dtype, bias added."""
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    w, x = rand(4, 3, seed=50, dtype=torch.bfloat16), rand(5, 3, seed=51, dtype=torch.bfloat16)
    d, *rest = general_gemm(w, x, torch.float32, layout="TN", bias=rand(4, seed=52))
    assert d.dtype == torch.float32 and rest == [None, None, None]
    close_to(d, x.float() @ w.float().T + rand(4, seed=52), "TN")
    g = rand(5, 4, seed=53)
    close_to(general_gemm(w.float(), g, torch.float32, layout="NN", grad=True)[0], g @ w.float(), "NN")
    close_to(general_gemm(x.float(), g, torch.float32, layout="NT", grad=True)[0], g.T @ x.float(), "NT")
    assert general_gemm(w, x, layout="TN")[0].dtype == torch.bfloat16  # out_dtype defaults to A's


def check_rope():
    """attention/rope.py apply_rotary_pos_emb(fused=True) with the fused kernel's arithmetic: the
    first d2 channels rotated pairwise (i, i + d2/2) by the position's angles, the rest passed."""
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    t = rand(6, 2, 3, 10, seed=60)
    angles = rand(8, 1, 1, 2, seed=61)
    freqs = torch.cat([angles, angles], dim=-1)  # as RoPE builds them; s2 = 8 >= s = 6, d2 = 4 <= d = 10
    out = apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", fused=True)
    half = torch.complex(t[..., :2], t[..., 2:4]) * torch.exp(1j * angles[:6])
    close_to(out[..., :4], torch.cat([half.real, half.imag], dim=-1), "rotated channels")
    assert torch.equal(out[..., 4:], t[..., 4:])
    assert apply_rotary_pos_emb(t.bfloat16(), freqs, fused=True).dtype == torch.bfloat16


def check_unmodelled():
    """FP8, userbuffers, fused MoE kernels and TE's offloading are not modelled: they raise
    NotImplementedError; their "off" settings behave as TE's do."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe
    from transformer_engine.pytorch import permutation
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    with te.fp8_autocast(enabled=False), te.fp8_model_init(enabled=False):
        assert not FP8GlobalStateManager.is_fp8_enabled()
    for fn in (lambda: contextlib.ExitStack().enter_context(te.fp8_autocast(enabled=True)), recipe.DelayedScaling,
               lambda: permutation.moe_permute(None, None), lambda: te.Linear(4, 4, device="cpu", ub_overlap_ag=True),
               lambda: te.get_cpu_offload_context(True)):
        _raises(NotImplementedError, fn, "an unmodelled path")
    ctx, sync = te.get_cpu_offload_context(False)  # cpu_offload.py ~815: a null context, identity
    x = torch.ones(1)
    with ctx:
        assert sync(x) is x


def check_megatron_state_dicts():
    """A TE-spec model built by mcore/models.py (VAPO_TE_SPEC_ON_CPU=1 in this world) at TP=2: TE's
    parameter names, `_extra_state` in every TE module's state_dict(), and megatron's sharded
    state dict wrapping the TE linears' and norms' (not the attention's) as ShardedObjects."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from model_providers.presets import preset
    from vapo_megatron.mcore.models import build_actor

    model = build_actor(preset("tiny-qwen3-moe"), params_dtype=torch.float32, sequence_parallel=True)
    assert model.config.transformer_impl == "transformer_engine" and model.config.moe_grouped_gemm
    names = {n for n, _ in model.named_parameters()}
    layer = "decoder.layers.0."
    assert {layer + "self_attention.linear_qkv.layer_norm_weight", layer + "mlp.experts.linear_fc1.weight3",
            layer + "mlp.experts.linear_fc2.weight0"} <= names, sorted(names)
    extra = {k for k in model.state_dict() if k.endswith("_extra_state") and k.startswith(layer)}
    assert extra == {layer + m + "._extra_state" for m in (
        "self_attention.core_attention", "self_attention.linear_proj", "self_attention.linear_qkv",
        "self_attention.q_layernorm", "self_attention.k_layernorm", "pre_mlp_layernorm",
        "mlp.experts.linear_fc1", "mlp.experts.linear_fc2")}, sorted(extra)
    sharded = model.sharded_state_dict()
    objects = {k for k, v in sharded.items() if isinstance(v, ShardedObject)}
    assert not any("core_attention" in k for k in objects), sorted(objects)
    assert {layer + "self_attention.linear_qkv._extra_state", layer + "mlp.experts.linear_fc1._extra_state3",
            "decoder.final_layernorm._extra_state"} <= objects, sorted(objects)


def check_bf16_models():
    """The project's bf16 actor and critic (mcore/models.py, TE spec, TP=2 with sequence
    parallelism), dense and MoE, run forward and backward under TE's dtype checks (base.py
    prepare_forward: every TE module's input in its parameters' dtype), every parameter reached."""
    from model_providers.presets import preset
    from vapo_megatron.mcore.models import build_actor, build_critic

    ids = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    for build, out_dtype in ((build_actor, torch.bfloat16), (build_critic, torch.float32)):  # the value head in fp32
        for name in ("tiny-qwen2", "tiny-qwen3-moe"):
            model = build(preset(name), params_dtype=torch.bfloat16, sequence_parallel=True)
            y = model(ids, torch.arange(8).expand(2, 8), None)
            assert y.dtype == out_dtype, (build.__name__, name, y.dtype)
            y.float().square().mean().backward()
            missing = [n for n, p in model.named_parameters() if p.grad is None]
            assert not missing, (build.__name__, name, missing)
