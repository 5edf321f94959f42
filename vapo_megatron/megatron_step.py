"""Megatron-Core plumbing shared by actor and critic: DDP, optimizer, one schedule call.

Gradient normalization (docs/normalization.md): `wrap_ddp` puts megatron in per-token loss
mode (``calculate_per_token_loss=True``). Then
  * DDP sums gradients over DP ranks (no 1/dp averaging),
  * the schedule neither divides a micro-batch's loss by its token count nor by the number
    of micro-batches, and
  * ``finalize_model_grads`` all-reduces the micro-batches' token counts over DP (after a
    broadcast from the last pipeline stage) and scales every gradient by 1 / that total.
Each loss function therefore returns (loss_sum, num_tokens, metrics) where the sum over all
micro-batches and ranks of num_tokens is the global token count N, and loss_sum is scaled so
that sum(loss_sum) / N is exactly the loss of the global mini-batch (see actor.py, critic.py).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from vapo_megatron import parallel
from vapo_megatron.config import OptimConfig


def wrap_ddp(model_chunks: list, *, distributed_optimizer: bool) -> list:
    """Megatron DDP around each chunk, and the schedule hooks that go with it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    tcfg = model_chunks[0].config
    # The schedule-facing fields of megatron's config are set here, where the training schedule
    # is assembled (as Megatron-LM does): per-token loss mode is what makes the normalization
    # exactly global (module docstring); DDP reads it at construction.
    tcfg.calculate_per_token_loss = True
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=chunk) for chunk in model_chunks
    ]
    for chunk in wrapped:
        chunk.broadcast_params()  # identical replicas across DP before the first step
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


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


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def warmup_lr(optim: OptimConfig, step: int) -> float:
    """Linear warm-up to optim.lr, then constant (the paper's schedule)."""
    if optim.warmup_steps <= 0:
        return optim.lr
    return optim.min_lr + (optim.lr - optim.min_lr) * min(1.0, (step + 1) / optim.warmup_steps)


def forward_backward(
    model_chunks: list,
    forward_step: Callable,
    micro_batches: list,
    *,
    forward_only: bool,
) -> list:
    """Run megatron's schedule over `micro_batches`; returns the last stage's loss outputs."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tcfg = model_chunks[0].config if not hasattr(model_chunks[0], "module") else model_chunks[0].module.config
    # Micro-batches differ in shape (token-budget batching): let the pipeline send shapes.
    tcfg.variable_seq_lengths = True
    longest = max(int(mb.tokens.shape[1]) for mb in micro_batches)
    if tcfg.sequence_parallel:  # actor._forward_step pads each micro-batch to a multiple of TP
        longest = -(-longest // parallel.tp_size()) * parallel.tp_size()
    widest = max(int(mb.tokens.shape[0]) for mb in micro_batches)
    if len(model_chunks) > 1:
        data = [iter(micro_batches) for _ in model_chunks]
    else:
        data = iter(micro_batches)
    if not forward_only:
        for chunk in model_chunks:
            chunk.zero_grad_buffer()
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=model_chunks,
        num_microbatches=len(micro_batches),
        seq_length=longest,
        micro_batch_size=widest,
        forward_only=forward_only,
    )


def reduce_metric_sums(outputs: list[dict]) -> dict[str, float]:
    """Sum per-micro-batch metric sums, over DP too; the result is known on every rank."""
    local: dict[str, float] = {}
    for out in outputs:
        for k, v in out.items():
            local[k] = local.get(k, 0.0) + float(v)
    holder = [sorted(local.items())]
    if parallel.pp_size() > 1:  # only the last stage computed losses
        last = dist.get_global_rank(parallel.pp_group(), parallel.pp_size() - 1)
        parallel.broadcast_object_list(holder, src=last, group=parallel.pp_group())
    keys = [k for k, _ in holder[0]]
    vals = torch.tensor([v for _, v in holder[0]], dtype=torch.float64)
    if parallel.dp_size() > 1 and len(keys):
        parallel.all_reduce(vals, group=parallel.dp_group())
    return dict(zip(keys, vals.tolist()))


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


def optimizer_step(optimizer, model_chunks: list, *, loss_finite: bool) -> tuple[bool, float]:
    """One step; returns (applied, grad_norm).

    A non-finite loss or gradient skips the step: parameters, Adam moments and step counts stay
    exactly as they were, and grad_norm is NaN. Megatron's FP32 and bf16 optimizers do not skip
    by themselves (only a loss-scaled fp16 optimizer checks for Inf, and this trainer has no fp16
    mode), so the check runs here, before the optimizer touches anything.
    """
    if not grads_and_losses_finite(model_chunks, loss_finite):
        applied, grad_norm = False, float("nan")
    else:
        applied, norm, _ = optimizer.step()
        grad_norm = float(norm) if norm is not None else 0.0
    # Megatron's FP32/mixed-precision optimizers point param.grad at the DDP main_grad buffer for
    # the step. Left in place, the next backward accumulates into param.grad (= main_grad) and
    # DDP's hook then adds param.grad to main_grad again: the first micro-batch's gradient
    # counts twice. Megatron-LM clears param.grad every iteration for this reason; so do we.
    optimizer.zero_grad(set_to_none=True)
    return bool(applied), grad_norm


def broadcast_from_last_stage(tensors: Iterable[torch.Tensor]) -> None:
    """Copy last-stage results (log-probs, values) to the other pipeline stages in place."""
    if parallel.pp_size() == 1:
        return
    last = dist.get_global_rank(parallel.pp_group(), parallel.pp_size() - 1)
    for t in tensors:
        parallel.broadcast(t, src=last, group=parallel.pp_group())
