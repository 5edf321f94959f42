"""The optimizer loop shared by the critic update (step 6) and the actor update (step 7).

Each update walks mini-batches of whole prompt groups (component 7), counts the global
normalizers of the mini-batch once (algorithms/normalization.py: one all-reduce over DP), splits
this rank's part into token-budget micro-batches, runs one schedule call (schedule.py) and one
guarded optimizer step (optimizer.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from vapo_megatron.algorithms.normalization import GlobalCounts, count_sums
from vapo_megatron.data.batch import RolloutBatch
from vapo_megatron.data.microbatch import padded_tokens, plan_micro_batches
from vapo_megatron.mcore import moe_metrics, parallel
from vapo_megatron.mcore.model import TrainModel
from vapo_megatron.mcore.optimizer import current_lr, optimizer_step
from vapo_megatron.mcore.schedule import broadcast_from_last_stage, forward_backward, reduce_metric_sums
from vapo_megatron.runtime import fault_points


@dataclass(frozen=True)
class UpdateSettings:
    mini_batches: int           # optimizer steps per epoch (algo.mini_batches)
    epochs: int                 # passes over the step's rollouts (algo.ppo_epochs)
    max_tokens: int             # token budget of a micro-batch (trainer.micro_batch_tokens)
    max_consecutive_skips: int  # trainer.max_consecutive_skips


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row were skipped for NaN/Inf losses or gradients."""


def forward_crosses_dp() -> bool:
    """Whether a forward pass runs collectives across data-parallel ranks: with expert parallelism
    megatron's MoE token dispatcher runs an all-to-all over the EP group (made of DP ranks) in every
    forward and backward, so DP ranks must run the same number of micro-batches or the all-to-alls
    pair across micro-batches (and across the actor's and critic's forwards) until one deadlocks."""
    return parallel.dp_size() > 1 and parallel.ep_size() > 1


def micro_batch_multiple() -> int:
    """The micro-batch count one schedule call must be a multiple of: megatron's interleaved (VPP)
    schedule takes them in groups of microbatch_group_size_per_vp_stage, PP by default, and refuses
    a remainder below PP (pipeline_parallel/schedules.py); 1 otherwise."""
    return parallel.pp_size() if parallel.vp_size() is not None else 1


def micro_batch_plan(batch: RolloutBatch, max_tokens: int) -> list[list[int]]:
    """Collective over DP where a forward crosses DP ranks. The rows of each micro-batch of one
    schedule call: token-budget micro-batches of this rank's rows (data/microbatch.py), as many on
    every DP rank when a forward runs collectives across them (expert parallelism:
    forward_crosses_dp), and a multiple of what the schedule takes (VPP: micro_batch_multiple). The
    count is the largest any rank plans, and the planner splits this rank's micro-batches up to it;
    a rank with fewer rows than that count adds fillers (rows []: see filler)."""
    lengths = batch.seq_lens.tolist()
    plan = plan_micro_batches(lengths, max_tokens)
    target = parallel.agree_max(len(plan)) if forward_crosses_dp() else len(plan)
    multiple = micro_batch_multiple()
    target = -(-target // multiple) * multiple
    if target > len(plan):
        plan = plan_micro_batches(lengths, max_tokens, min_micro_batches=min(target, len(lengths)))
    return plan + [[] for _ in range(target - len(plan))]  # fillers only where rows ran short


def micro_batches(batch: RolloutBatch, max_tokens: int) -> tuple[list[list[int]], list[RolloutBatch]]:
    """Collective as micro_batch_plan. (plan, micro-batches): each plan entry's rows selected, a
    filler for each empty one: one of its sequences with no response token, which every loss and
    count masks out (zero loss, zero tokens)."""
    plan = micro_batch_plan(batch, max_tokens)
    return plan, [batch.select(rows) if rows else filler(batch) for rows in plan]


def padding_ratio(batch: RolloutBatch, max_tokens: int) -> float:
    """perf/padding_ratio: the padding share of the tokens this rank's scoring forward processes, in
    the plan it runs (micro_batch_plan: collective where that is): each micro-batch padded to its
    longest sequence, a filler's tokens (row 0's prompt) all padding. Nothing is copied."""
    plan = micro_batch_plan(batch, max_tokens)
    lengths = batch.seq_lens.tolist()
    real = sum(lengths[i] for rows in plan for i in rows)
    processed = padded_tokens(plan, lengths) + int(batch.prompt_lens[0]) * sum(not rows for rows in plan)
    return (processed - real) / processed if processed else 0.0


def filler(batch: RolloutBatch) -> RolloutBatch:
    """A micro-batch that changes nothing: row 0 with no response (mask all zero, not correct), so
    its forward runs every collective a real one runs and adds 0 to every loss sum and token count."""
    one = batch.select([0])
    return replace(one, response_lens=torch.zeros_like(one.response_lens), correct=torch.zeros_like(one.correct))


def mini_batch_rows(batch: RolloutBatch, n: int) -> list[list[int]]:
    """Split rows into n mini-batches of whole prompt groups (group_ids are contiguous)."""
    groups = torch.unique_consecutive(batch.group_ids)
    parts = torch.tensor_split(groups, n)
    return [torch.nonzero(torch.isin(batch.group_ids, p)).flatten().tolist() for p in parts]


def global_counts(batch: RolloutBatch) -> GlobalCounts:
    """N, N_pos, M of the global mini-batch (every DP rank's part; one all-reduce)."""
    sums = count_sums(batch.mask, batch.correct)
    if parallel.dp_size() > 1:
        parallel.all_reduce(sums, group=parallel.dp_group())
    return GlobalCounts.from_sums(sums)


def forward_only(model: TrainModel, batch: RolloutBatch, loss_fn: Callable, keys: tuple[str, ...],
                 max_tokens: int) -> dict[str, torch.Tensor]:
    """Step 4's forward passes: {key: [B, S] float32} on every pipeline stage, from the
    last stage's per-micro-batch outputs (loss_fn returns them under `keys`). When the model's
    routing replay is counting (routing_replay.py), also "routing_mismatch" [B, S]."""
    plan, micro = micro_batches(batch, max_tokens)
    replay = model.replay
    with torch.no_grad():
        outputs = forward_backward(model.chunks, loss_fn, micro, forward_only=True, replay=replay)
    out = {}
    for key in keys:
        full = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        if parallel.is_last_stage():
            for rows, o in zip(plan, outputs):
                if rows:  # a filler's outputs belong to no row
                    full[rows, : o[key].shape[1]] = o[key]
        broadcast_from_last_stage([full])
        out[key] = full * batch.mask
    if replay is not None and replay.counts is not None:
        out["routing_mismatch"] = replay.mismatch_flags(plan, batch.tokens.shape)
    return out


def _means(sums: dict[str, float], counts: GlobalCounts) -> dict[str, float]:
    """Metric sums -> means over the right global count (N_pos for the NLL, else N)."""
    out = {}
    for key, value in sums.items():
        name = key[: -len("_sum")] if key.endswith("_sum") else key
        denom = counts.pos_tokens if name.endswith("nll_loss") else counts.tokens
        out[name] = value / max(denom, 1)
    return out


def guarded_step(model: TrainModel, sums: dict[str, float], role: str,
                 max_consecutive_skips: int) -> tuple[bool, float]:
    """One optimizer step that is skipped (and counted) when a loss or the gradient norm is not
    finite; after `max_consecutive_skips` skips in a row the run stops (NonFiniteError)."""
    loss_finite = all(math.isfinite(v) for k, v in sums.items() if k.endswith("loss_sum")) \
        and not fault_points.poisoned("nan_loss")  # runtime/fault_points.py
    applied, grad_norm = optimizer_step(model.optimizer, model.chunks, loss_finite=loss_finite,
                                        scheduler=model.scheduler)
    model.consecutive_skips = 0 if applied else model.consecutive_skips + 1
    if model.consecutive_skips >= max_consecutive_skips:
        raise NonFiniteError(
            f"{role}: {model.consecutive_skips} optimizer steps in a row were skipped because a loss or the gradient "
            f"norm was NaN/Inf (trainer.max_consecutive_skips={max_consecutive_skips}). The parameters are those of "
            "the last good step and the checkpoints are untouched; lower the learning rate or check the data and "
            "rewards, then resume from the latest checkpoint."
        )
    if not applied and parallel.is_rank0():
        print(f"[vapo] {role}: optimizer step skipped (non-finite loss or gradient norm), "
              f"{model.consecutive_skips} in a row", flush=True)
    return applied, grad_norm


def optimize(model: TrainModel, role: str, batch: RolloutBatch, loss_for: Callable[[GlobalCounts], Callable],
             settings: UpdateSettings, *, parts: list[list[int]] | None = None) -> dict[str, float]:
    """One optimizer step per mini-batch and epoch. `loss_for(counts)` is the loss function of a
    mini-batch with these global counts (docs/normalization.md). Logs are means over the steps,
    except `<role>/skipped_steps`, which counts them; `<role>/lr` is the learning rate the steps
    used (the schedule's next one when the model did not step). parts: this rank's rows of each
    mini-batch, when another layout dealt them (the critic's own: mcore/critic_share.py); None:
    mini_batch_rows of the batch (settings.mini_batches of whole prompt groups)."""
    logs: dict[str, list[float]] = {}
    for _ in range(settings.epochs):
        for rows in parts if parts is not None else mini_batch_rows(batch, settings.mini_batches):
            part = batch.select(rows)
            counts = global_counts(part)
            _, micro = micro_batches(part, settings.max_tokens)
            lr = current_lr(model.optimizer)
            moe_metrics.clear()
            sums = reduce_metric_sums(forward_backward(model.chunks, loss_for(counts), micro, forward_only=False,
                                                       replay=model.replay))
            aux_loss = moe_metrics.take_aux_loss(model.config, len(micro))
            applied, grad_norm = guarded_step(model, sums, role, settings.max_consecutive_skips)
            fault_points.point(f"{role}_update")  # a crash mid-update (runtime/fault_points.py)
            step_logs = _means(sums, counts)
            step_logs[f"{role}/grad_norm"] = grad_norm
            step_logs[f"{role}/skipped_steps"] = 0.0 if applied else 1.0
            step_logs[f"{role}/lr"] = lr
            if aux_loss is not None:  # a MoE model with model.moe_aux_loss_coeff > 0
                step_logs[f"{role}/moe_aux_loss"] = aux_loss
            for k, v in step_logs.items():
                logs.setdefault(k, []).append(v)
    return {k: (sum(v) if k.endswith("skipped_steps") else sum(v) / len(v)) for k, v in logs.items()}


__all__ = ["NonFiniteError", "UpdateSettings", "forward_only", "global_counts", "guarded_step", "micro_batch_plan",
           "micro_batches", "mini_batch_rows", "optimize", "padding_ratio"]
