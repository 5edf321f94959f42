"""Megatron's optimizer, its learning-rate schedule, and the guarded optimizer step.

    build_optimizer(chunks, optim_cfg)       megatron's Adam (torch's AdamW underneath without Apex/TE)
    build_lr_scheduler(optimizer, optim_cfg) megatron's OptimizerParamScheduler: warm-up, then
                                             constant or decay to min_lr (config/schema.py, OptimConfig)
    optimizer_step(model, loss_finite)       one step, skipped when a loss or gradient is not finite;
                                             the schedule advances only on an applied step

The schedule counts a model's applied optimizer updates; RunState.lr_steps saves the count and a
resume sets it back, so the schedule resumes exactly (checkpoint/run_state.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from vapo_megatron.config import OptimConfig
from vapo_megatron.mcore import parallel


def build_optimizer(model_chunks: list, optim: OptimConfig, *, params_dtype: torch.dtype, kind: str = "adam"):
    """Megatron's optimizer (torch AdamW/SGD underneath when Apex/TE are absent)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ocfg = OptimizerConfig(
        optimizer=kind,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        sgd_momentum=0.0,
        clip_grad=optim.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=optim.distributed_optimizer,
    )
    return get_megatron_optimizer(ocfg, model_chunks)


def build_lr_scheduler(optimizer, optim: OptimConfig, *, planned_updates: int):
    """The schedule of OptimConfig: update s (0-based) uses lr * s / warmup_steps while s <=
    warmup_steps (megatron's warm-up starts at 0), then lr ("constant"), or decays to min_lr by
    update lr_decay_steps ("linear", "cosine"; null: `planned_updates`, the run's last update)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = optim.lr_decay_steps if optim.lr_decay_steps is not None else planned_updates
    decay_steps = max(decay_steps, optim.warmup_steps + 1)  # megatron asserts warm-up < decay
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr, lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
        # The config is the schedule's one source; only the step count comes from a checkpoint.
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
    )


def set_lr_steps(scheduler, steps: int) -> None:
    """Put the schedule at `steps` applied updates (a resume), setting the optimizer's lr."""
    scheduler.num_steps = 0
    scheduler.step(steps)


def current_lr(optimizer) -> float:
    """The learning rate the next optimizer step applies (megatron's logging convention: the
    first default-config param group)."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    lr = get_canonical_lr_for_logging(optimizer.param_groups)
    return float(lr if lr is not None else optimizer.param_groups[0]["lr"])


FP32_MAX = torch.finfo(torch.float32).max


def grads_and_losses_finite(model_chunks: list, loss_finite: bool) -> bool:
    """Collective over all ranks: True when no rank has a non-finite loss or gradient.

    Reads the DDP gradient buffers, which every optimizer path (fp32, bf16, distributed) steps
    from. A NaN/Inf anywhere makes that buffer's L2 norm non-finite; a norm whose square would
    overflow float32 (||g|| > ~1.8e19) counts as non-finite too, since Megatron's own fp32 grad
    norm would be Inf and its clipping would then zero the gradients *and still step* Adam. With
    the distributed optimizer a buffer holds this rank's reduced shard plus unreduced local
    gradients elsewhere; a non-finite reduced value comes from a non-finite local one on some
    rank or shows up in its owner's shard, so the world-wide sum sees it either way.
    """
    # Squared norms summed where the buffers live (CUDA on GPUs): no CPU scalar += CUDA value.
    squares = [torch.linalg.vector_norm(buf.grad_data).double().square()
               for chunk in model_chunks for buf in chunk.buffers + chunk.expert_parallel_buffers]
    sq = torch.stack(squares).sum().cpu() if squares else torch.zeros((), dtype=torch.float64)
    flags = torch.stack([sq, torch.tensor(0.0 if loss_finite else 1.0, dtype=torch.float64)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        parallel.all_reduce(flags)  # every rank takes the same decision (the step is collective)
    total_sq, bad_losses = flags.tolist()
    return bad_losses == 0 and math.isfinite(total_sq) and total_sq < FP32_MAX


def optimizer_step(optimizer, model_chunks: list, *, loss_finite: bool, scheduler=None) -> tuple[bool, float]:
    """One step; returns (applied, grad_norm).

    A non-finite loss or gradient skips the step: parameters, Adam moments, step counts and the
    LR schedule stay exactly as they were, and grad_norm is NaN. Megatron's FP32 and bf16
    optimizers do not skip by themselves (only a loss-scaled fp16 optimizer checks for Inf, and
    this trainer has no fp16 mode), so the check runs here, before the optimizer touches anything.
    """
    if not grads_and_losses_finite(model_chunks, loss_finite):
        applied, grad_norm = False, float("nan")
    else:
        applied, norm, _ = optimizer.step()
        grad_norm = float(norm) if norm is not None else 0.0
        if applied and scheduler is not None:
            scheduler.step(1)  # as Megatron-LM: the schedule counts successful updates only
    # Megatron's FP32/mixed-precision optimizers point param.grad at the DDP main_grad buffer for
    # the step. Left in place, the next backward accumulates into param.grad (= main_grad) and
    # DDP's hook then adds param.grad to main_grad again: the first micro-batch's gradient
    # counts twice. Megatron-LM clears param.grad every iteration for this reason; so do we.
    optimizer.zero_grad(set_to_none=True)
    return bool(applied), grad_norm


__all__ = ["build_lr_scheduler", "build_optimizer", "current_lr", "grads_and_losses_finite", "optimizer_step",
           "set_lr_steps"]
