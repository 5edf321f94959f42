"""Steps 4, 6 and 7 of the loop on Megatron models: score, critic update, actor update.

Each update walks mini-batches (whole prompt groups, component 7), counts the global
normalizers once per mini-batch (normalization.py), splits this rank's part into token-budget
micro-batches and runs one schedule call and one optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vapo_megatron import actor as actor_mod
from vapo_megatron import critic as critic_mod
from vapo_megatron import faults, parallel
from vapo_megatron.algorithms.losses import explained_variance_from_sums, explained_variance_sums
from vapo_megatron.batch import RolloutBatch
from vapo_megatron.data.microbatch import padding_ratio, plan_micro_batches
from vapo_megatron.megatron_step import broadcast_from_last_stage, optimizer_step, reduce_metric_sums, set_lr
from vapo_megatron.normalization import GlobalCounts, global_counts


@dataclass
class TrainModel:
    """One Megatron model (DDP-wrapped chunks) with its optimizer and HF identity."""

    chunks: list
    optimizer: object
    family: object
    hf_cfg: dict
    vocab_size: int  # real (unpadded) vocabulary
    consecutive_skips: int = 0  # optimizer steps skipped in a row (non-finite loss or gradient)

    @property
    def modules(self) -> list:
        return [c.module for c in self.chunks]


def micro_batches(batch: RolloutBatch, max_tokens: int) -> tuple[list[list[int]], list[RolloutBatch]]:
    plan = plan_micro_batches(batch.seq_lens.tolist(), max_tokens)
    return plan, [batch.select(rows) for rows in plan]


def mini_batch_rows(batch: RolloutBatch, n: int) -> list[list[int]]:
    """Split rows into n mini-batches of whole prompt groups (group_ids are contiguous)."""
    groups = torch.unique_consecutive(batch.group_ids)
    parts = torch.tensor_split(groups, n)
    return [torch.nonzero(torch.isin(batch.group_ids, p)).flatten().tolist() for p in parts]


def _assemble(batch: RolloutBatch, plan: list[list[int]], outputs: list[dict] | None, key: str) -> torch.Tensor:
    """Per-micro-batch [b, w] outputs of the last stage -> [B, S] on every pipeline stage."""
    full = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    if outputs is not None:
        for rows, out in zip(plan, outputs):
            full[rows, : out[key].shape[1]] = out[key]
    broadcast_from_last_stage([full])
    return full


def score_with_models(actor: TrainModel, critic: TrainModel, batch: RolloutBatch, *, temperature: float,
                      max_tokens: int, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 4: trainer-side old log-probs, their entropy, and critic values, all [B, S].

    Old log-probs are recomputed by the trainer, not taken from the rollout engine (sec. 3).
    """
    plan, micro = micro_batches(batch, max_tokens)
    logp_out = actor_mod.compute_logprobs(actor.chunks, micro, temperature=temperature, vocab_size=actor.vocab_size,
                                          chunk_tokens=chunk_tokens)
    value_out = critic_mod.compute_values(critic.chunks, micro)
    mask = batch.mask
    old_logp = _assemble(batch, plan, logp_out, "logp") * mask
    entropy = _assemble(batch, plan, logp_out, "entropy") * mask
    values = _assemble(batch, plan, value_out, "values") * mask
    return old_logp, entropy, values


def _finish(sums: dict[str, float], counts: GlobalCounts) -> dict[str, float]:
    """Turn metric sums into means over the right global count."""
    out = {}
    for key, value in sums.items():
        name = key[: -len("_sum")] if key.endswith("_sum") else key
        denom = counts.pos_tokens if name.endswith("nll_loss") else counts.tokens
        out[name] = value / max(denom, 1)
    return out


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row were skipped for NaN/Inf losses or gradients."""


def _step(model: TrainModel, sums: dict[str, float], role: str, max_consecutive_skips: int) -> tuple[bool, float]:
    """One optimizer step that is skipped (and counted) when a loss or the gradient norm is not
    finite; after `max_consecutive_skips` skips in a row the run stops (NonFiniteError)."""
    loss_finite = all(math.isfinite(v) for k, v in sums.items() if k.endswith("loss_sum"))
    applied, grad_norm = optimizer_step(model.optimizer, model.chunks, loss_finite=loss_finite)
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


def update_critic(critic: TrainModel, batch: RolloutBatch, *, clip_range: float | None, mini_batches: int,
                  epochs: int, max_tokens: int, lr: float, max_consecutive_skips: int) -> dict[str, float]:
    """Step 6: clipped value loss against `batch.returns`, token-level over each mini-batch."""
    return _optimize(critic, "critic", batch, lambda micro, counts: critic_mod.train_mini_batch(critic.chunks, micro, clip_range=clip_range),
                     mini_batches=mini_batches, epochs=epochs, max_tokens=max_tokens, lr=lr,
                     max_consecutive_skips=max_consecutive_skips)


def update_actor(actor: TrainModel, batch: RolloutBatch, settings: actor_mod.PolicyLossSettings, *,
                 mini_batches: int, epochs: int, max_tokens: int, lr: float,
                 max_consecutive_skips: int) -> dict[str, float]:
    """Step 7: PPO (clip-higher, token-level) + mu * positive-example NLL."""
    return _optimize(actor, "actor", batch,
                     lambda micro, counts: actor_mod.train_mini_batch(actor.chunks, micro, settings, counts, vocab_size=actor.vocab_size),
                     mini_batches=mini_batches, epochs=epochs, max_tokens=max_tokens, lr=lr,
                     max_consecutive_skips=max_consecutive_skips)


def _optimize(model: TrainModel, role: str, batch: RolloutBatch, train_mini_batch, *, mini_batches: int, epochs: int,
              max_tokens: int, lr: float, max_consecutive_skips: int) -> dict[str, float]:
    """The loop shared by steps 6 and 7: one optimizer step per mini-batch and epoch, with the
    global counts of that mini-batch (docs/normalization.md). `train_mini_batch(micro, counts)`
    runs forward/backward and returns the metric sums. Logs are means over the steps, except
    `<role>/skipped_steps`, which counts them."""
    set_lr(model.optimizer, lr)
    logs: dict[str, list[float]] = {}
    for _ in range(epochs):
        for rows in mini_batch_rows(batch, mini_batches):
            part = batch.select(rows)
            counts = global_counts(part, parallel.dp_group())
            _, micro = micro_batches(part, max_tokens)
            sums = reduce_metric_sums(train_mini_batch(micro, counts))
            applied, grad_norm = _step(model, sums, role, max_consecutive_skips)
            faults.fault_point(f"{role}_update")  # test-only (faults.py): a crash mid-update
            step_logs = _finish(sums, counts)
            step_logs[f"{role}/grad_norm"] = grad_norm
            step_logs[f"{role}/skipped_steps"] = 0.0 if applied else 1.0
            for k, v in step_logs.items():
                logs.setdefault(k, []).append(v)
    return {k: (sum(v) if k.endswith("skipped_steps") else sum(v) / len(v)) for k, v in logs.items()}


def explained_variance(batch: RolloutBatch) -> float:
    """critic/explained_variance = 1 - Var(G - V) / Var(G) over all response tokens (global)."""
    sums = explained_variance_sums(batch.values, batch.returns, batch.mask)
    keys = sorted(sums)
    vec = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64)
    if parallel.dp_size() > 1:
        parallel.all_reduce(vec, group=parallel.dp_group())
    ev = explained_variance_from_sums(dict(zip(keys, vec)))
    return float(ev) if math.isfinite(float(ev)) else float("nan")


def batch_padding_ratio(batch: RolloutBatch, max_tokens: int) -> float:
    lengths = batch.seq_lens.tolist()
    return padding_ratio(plan_micro_batches(lengths, max_tokens), lengths)
