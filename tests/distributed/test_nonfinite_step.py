"""A NaN/Inf loss or gradient skips the optimizer step without touching anything (docs/faults.md,
Numerics): one rank, the project's model provider, megatron DDP and megatron's optimizer as
the trainer builds them (mcore/model.py's wrap_ddp, mcore/optimizer.py's build_optimizer), gradients from a real
backward pass into megatron's gradient buffers. The reference is the state before the step."""

from __future__ import annotations

import math

import torch

from model_providers.presets import preset
from tests.helpers.dist_utils import run_ranks


def _backward(chunk, hf_cfg: dict, scale: float) -> None:
    """One forward/backward of a fixed batch; the gradients land in DDP's main_grad buffers."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf_cfg["vocab_size"], (2, 12), generator=gen)
    chunk.zero_grad_buffer()
    logits = chunk(ids, torch.arange(12).expand(2, 12), None)  # [B, T, V_padded]
    (logits.float().square().mean() * scale).backward()


def _snapshot(chunk, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and every optimizer tensor (fp32 main params, Adam moments and step)."""
    out = {f"param/{n}": p.detach().clone() for n, p in chunk.module.named_parameters()}
    for i, opt in enumerate(optimizer.chained_optimizers):
        for j, group in enumerate(opt.optimizer.param_groups):
            for k, p in enumerate(group["params"]):  # the tensors Adam updates (fp32 copies under bf16)
                out[f"main/{i}.{j}.{k}"] = p.detach().clone()
                for key, value in opt.optimizer.state[p].items():
                    out[f"state/{i}.{j}.{k}.{key}"] = torch.as_tensor(value).clone()
    return out


def _same(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def _skip_and_step(dtype_name: str) -> dict:
    from model_providers import QWEN2
    from vapo_megatron.config import OptimConfig
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.model import TrainModel, wrap_ddp
    from vapo_megatron.mcore.models import build_actor
    from vapo_megatron.mcore.optimizer import build_lr_scheduler, build_optimizer, optimizer_step
    from vapo_megatron.mcore.update import NonFiniteError, guarded_step

    parallel.init_distributed(1, 1, seed=3)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    hf_cfg = preset("tiny-qwen2")
    chunks = wrap_ddp([build_actor(hf_cfg, params_dtype=dtype)], distributed_optimizer=False)
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=3)
    optimizer = build_optimizer(chunks, optim, params_dtype=dtype)
    scheduler = build_lr_scheduler(optimizer, optim, planned_updates=10)  # warm-up: the rate moves every step
    chunk = chunks[0]
    results = {}

    # A first finite step, so that Adam has moments and a step count to protect.
    _backward(chunk, hf_cfg, 1.0)
    assert optimizer_step(optimizer, chunks, loss_finite=True, scheduler=scheduler)[0]
    before = _snapshot(chunk, optimizer)
    lr_before = (scheduler.num_steps, [g["lr"] for g in optimizer.param_groups])
    assert any(k.endswith(".step") for k in before), "Adam's step count is not where the test looks"

    # 1. NaN gradients everywhere (a NaN loss's backward).
    _backward(chunk, hf_cfg, float("nan"))
    results["nan_grads"] = (optimizer_step(optimizer, chunks, loss_finite=True, scheduler=scheduler),
                            _same(before, _snapshot(chunk, optimizer)))
    # 2. One Inf element in the gradient buffer, the rest finite.
    _backward(chunk, hf_cfg, 1.0)
    chunk.buffers[0].grad_data[7] = float("inf")
    results["one_inf"] = (optimizer_step(optimizer, chunks, loss_finite=True, scheduler=scheduler),
                          _same(before, _snapshot(chunk, optimizer)))
    # 3. Finite gradients, but a loss reported as non-finite.
    _backward(chunk, hf_cfg, 1.0)
    results["nan_loss"] = (optimizer_step(optimizer, chunks, loss_finite=False, scheduler=scheduler),
                           _same(before, _snapshot(chunk, optimizer)))
    # 4. Finite gradients whose squared norm overflows float32: megatron's clipping would see an
    #    Inf norm, zero the gradients and still step Adam.
    _backward(chunk, hf_cfg, 1.0)
    chunk.buffers[0].grad_data.fill_(1e20)
    results["norm_overflow"] = (optimizer_step(optimizer, chunks, loss_finite=True, scheduler=scheduler),
                                _same(before, _snapshot(chunk, optimizer)))
    # The skips did not advance the learning-rate schedule either.
    results["lr_after_skips"] = (lr_before, (scheduler.num_steps, [g["lr"] for g in optimizer.param_groups]))
    # 5. A finite step after the skips changes the parameters and the optimizer state.
    _backward(chunk, hf_cfg, 1.0)
    applied, norm = optimizer_step(optimizer, chunks, loss_finite=True, scheduler=scheduler)
    results["lr_steps_after_finite"] = scheduler.num_steps
    after = _snapshot(chunk, optimizer)
    results["finite"] = ((applied, norm), _same(before, after))
    results["steps"] = sorted({float(v) for k, v in after.items() if k.endswith(".step")})
    results["n_params"] = sum(k.startswith("param/") for k in before)
    results["n_state"] = sum(k.startswith("state/") for k in before)

    # The trainer's wrapper counts skips in a row, resets on a good step, and stops at the limit.
    model = TrainModel(chunks=chunks, optimizer=optimizer, scheduler=None, family=QWEN2, hf_cfg=hf_cfg, hf_dir=None,
                       critic=False, dtype=dtype_name)
    nan_sums = {"actor/pg_loss_sum": float("nan"), "actor/clipfrac_sum": 1.0}
    counts = []
    _backward(chunk, hf_cfg, 1.0)
    counts.append((guarded_step(model, nan_sums, "actor", 2)[0], model.consecutive_skips))
    _backward(chunk, hf_cfg, 1.0)
    counts.append((guarded_step(model, {"actor/pg_loss_sum": 0.5}, "actor", 2)[0], model.consecutive_skips))
    _backward(chunk, hf_cfg, 1.0)
    counts.append((guarded_step(model, nan_sums, "actor", 2)[0], model.consecutive_skips))
    _backward(chunk, hf_cfg, 1.0)
    try:
        guarded_step(model, nan_sums, "actor", 2)
        results["error"] = None
    except NonFiniteError as e:
        results["error"] = str(e)
    results["counts"] = counts
    return results


def _check(dtype_name: str) -> None:
    (r,) = run_ranks(1, _skip_and_step, dtype_name)
    assert r["n_params"] > 10 and r["n_state"] >= 3 * r["n_params"]  # exp_avg, exp_avg_sq, step per tensor
    for case in ("nan_grads", "one_inf", "nan_loss", "norm_overflow"):
        (applied, norm), changed = r[case]
        assert not applied and math.isnan(norm), case
        assert changed == [], f"{case}: a skipped step changed {changed}"
    (applied, norm), changed = r["finite"]
    assert applied and math.isfinite(norm)
    params = [k for k in changed if k.startswith("param/")]
    assert len(params) >= r["n_params"] - 1, ("the finite step left parameters unchanged: "
                                              f"{sorted(set(r) - set(params))}")
    assert any(k.startswith("state/") and k.endswith("exp_avg") for k in changed)
    assert r["steps"] == [2.0]  # the skipped steps were not counted by Adam
    (steps_before, lrs_before), (steps_after, lrs_after) = r["lr_after_skips"]
    assert steps_before == steps_after == 1 and lrs_before == lrs_after  # nor by the LR schedule
    assert r["lr_steps_after_finite"] == 2
    assert r["counts"] == [(False, 1), (True, 0), (False, 1)]
    assert r["error"] is not None and r["error"].startswith("actor: 2 optimizer steps in a row were skipped")
    assert "trainer.max_consecutive_skips=2" in r["error"]


def test_skipped_step_leaves_fp32_params_and_adam_state_bitwise_unchanged():
    _check("float32")


def test_skipped_step_leaves_bf16_params_and_fp32_main_state_bitwise_unchanged():
    _check("bfloat16")
