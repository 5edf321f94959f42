"""Figures of a step over every data-parallel rank: sums and means of per-token quantities, the
critic's explained variance, and advantage whitening with global statistics (docs/algorithm.md,
the parallel-aware form). Each is one all-reduce over the DP group of a few float64 numbers."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from vapo_megatron.algorithms import off_policy as off_policy_math
from vapo_megatron.algorithms.losses import (explained_variance_from_sums, explained_variance_sums,
                                             masked_moment_sums, whiten)
from vapo_megatron.data.batch import RolloutBatch, pad_ragged, to_sequence
from vapo_megatron.data.microbatch import padding_ratio, plan_micro_batches
from vapo_megatron.mcore import parallel


def dp_sum(t: torch.Tensor) -> torch.Tensor:
    """t summed in place over the data-parallel group (the reduction the estimators take)."""
    if parallel.dp_size() > 1:
        parallel.all_reduce(t, group=parallel.dp_group())
    return t



def global_sum(value: float) -> float:
    return float(dp_sum(torch.tensor([value], dtype=torch.float64)))


def global_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of x over the masked positions of every DP rank's batch."""
    t = dp_sum(torch.tensor([float((x * mask).sum()), float(mask.sum())], dtype=torch.float64))
    return float(t[0] / t[1].clamp(min=1))


def whiten_advantages(batch: RolloutBatch) -> torch.Tensor:
    """Advantages whitened with the mean and variance over all response tokens of the global batch."""
    return whiten(batch.advantages, batch.mask, dp_sum(masked_moment_sums(batch.advantages, batch.mask).double()))


def explained_variance(batch: RolloutBatch) -> float:
    """critic/explained_variance = 1 - Var(G - V) / Var(G) over all response tokens (global)."""
    sums = explained_variance_sums(batch.values, batch.returns, batch.mask)
    keys = sorted(sums)
    vec = dp_sum(torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64))
    ev = explained_variance_from_sums(dict(zip(keys, vec)))
    return float(ev) if math.isfinite(float(ev)) else float("nan")


def engine_logprob_diff(batch: RolloutBatch) -> float:
    """Mean |engine log-prob - trainer log-prob| over response tokens: the rollout/trainer
    mismatch (kernels, precision) that recomputing old log-probs protects PPO from."""
    engine = to_sequence(pad_ragged(batch.extras["engine_logp"]), batch.prompt_lens, batch.response_lens,
                         batch.tokens.shape[1])
    return global_mean((engine - batch.old_logp).abs(), batch.mask)


def off_policy(batch: RolloutBatch, *, version: int, cap: float, max_staleness: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Partial rollout: decoupled PPO's weight of each token [B, S] (algorithms/off_policy.py: 1 on
    tokens of `version`, the policy whose old log-probs batch.old_logp holds) and its figures over
    every DP rank: partial/staleness_<k> (share of response tokens k versions old; the last bin
    counts max_staleness + 1 and more, which the step never trains on), partial/stale_fraction, and
    over the stale tokens partial/is_ratio_mean, _std, _min, _max (pi_prox / pi_behav before the
    cap), partial/is_weight_mean (after it) and partial/is_truncated_fraction."""
    S = batch.tokens.shape[1]
    seq = lambda rows: to_sequence(pad_ragged(rows), batch.prompt_lens, batch.response_lens, S)  # noqa: E731
    mask = batch.mask
    by = off_policy_math.staleness(seq([[float(v) for v in r] for r in batch.extras["token_versions"]]), mask, version)
    stale = (by > 0) & (mask != 0)
    ratios = off_policy_math.importance_ratios(batch.old_logp, seq(batch.extras["engine_logp"]), stale)
    weights = off_policy_math.truncated_weights(ratios, cap)
    bins = max_staleness + 1
    sums = dp_sum(torch.cat([off_policy_math.weight_sums(ratios, weights, stale, cap),
                              off_policy_math.staleness_counts(by, mask, bins)]))
    real = ratios[stale].double()
    extremes = torch.tensor([float(real.max()) if len(real) else -math.inf, -float(real.min()) if len(real) else -math.inf],
                            dtype=torch.float64)
    if parallel.dp_size() > 1:
        parallel.all_reduce(extremes, op=dist.ReduceOp.MAX, group=parallel.dp_group())
    n_stale, ratio_sum, weight_sum, truncated, ratio_sq = sums[:5].tolist()
    counts = sums[5:]
    logs = {f"partial/staleness_{k}": float(counts[k] / counts.sum().clamp(min=1)) for k in range(bins)}
    logs[f"partial/staleness_{bins}_or_more"] = float(counts[bins] / counts.sum().clamp(min=1))
    logs["partial/stale_fraction"] = n_stale / max(float(counts.sum()), 1.0)
    if n_stale:
        mean = ratio_sum / n_stale
        logs |= {"partial/is_ratio_mean": mean, "partial/is_ratio_std": math.sqrt(max(ratio_sq / n_stale - mean * mean, 0.0)),
                 "partial/is_ratio_max": float(extremes[0]), "partial/is_ratio_min": -float(extremes[1]),
                 "partial/is_weight_mean": weight_sum / n_stale, "partial/is_truncated_fraction": truncated / n_stale}
    return torch.where(mask != 0, weights, torch.ones(())), logs


def batch_padding_ratio(batch: RolloutBatch, max_tokens: int) -> float:
    """Padding share of this rank's micro-batches (perf/padding_ratio)."""
    lengths = batch.seq_lens.tolist()
    return padding_ratio(plan_micro_batches(lengths, max_tokens), lengths)


__all__ = ["batch_padding_ratio", "engine_logprob_diff", "explained_variance", "global_mean", "global_sum",
           "off_policy", "whiten_advantages"]
