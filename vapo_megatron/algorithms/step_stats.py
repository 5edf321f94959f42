"""A step's figures over every data-parallel rank, as pure functions handed the reduction they
need (docs/algorithm.md, the parallel-aware form): `reduce(t)` sums a float64 vector over the DP
group and returns it, `reduce_max(t)` takes its elementwise max (mcore/dp_stats.py dp_sum and
dp_max; on one rank both return t). Each function makes the same one or two reductions of a few
numbers on every rank, whatever its rows: never a collective whose count depends on the data.

Shapes: B sequences, S positions (data/batch.py's sequence layout); `mask` [B, S] is 1 on the
response tokens a loss counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from vapo_megatron.algorithms import off_policy as op
from vapo_megatron.algorithms.losses import (
    explained_variance_from_sums,
    explained_variance_sums,
    masked_moment_sums,
    whiten,
)
from vapo_megatron.data.batch import RolloutBatch, pad_ragged, to_sequence

Reduce = Callable[[Tensor], Tensor]


def global_mean(x: Tensor, mask: Tensor, *, reduce: Reduce) -> float:
    """Mean of x [B, S] over the masked positions of every DP rank's batch."""
    t = reduce(torch.tensor([float((x * mask).sum()), float(mask.sum())], dtype=torch.float64))
    return float(t[0] / t[1].clamp(min=1))


def whiten_advantages(advantages: Tensor, mask: Tensor, *, reduce: Reduce) -> Tensor:
    """Advantages [B, S] whitened with the mean and variance over all response tokens of the global
    batch (algo.whiten_advantages)."""
    return whiten(advantages, mask, reduce(masked_moment_sums(advantages, mask).double()))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, *, reduce: Reduce) -> float:
    """critic/explained_variance = 1 - Var(G - V) / Var(G) over all response tokens (global); NaN
    when it is undefined (no variance in G)."""
    sums = explained_variance_sums(values, returns, mask)
    keys = sorted(sums)
    vec = reduce(torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64))
    ev = float(explained_variance_from_sums(dict(zip(keys, vec))))
    return ev if math.isfinite(ev) else float("nan")


def engine_logprob_diff(batch: RolloutBatch, *, reduce: Reduce) -> float:
    """Mean |engine log-prob - trainer log-prob| over response tokens: the rollout/trainer
    mismatch (kernels, precision) that recomputing old log-probs protects PPO from."""
    engine = to_sequence(pad_ragged(batch.extras["engine_logp"]), batch.prompt_lens, batch.response_lens,
                         batch.tokens.shape[1])
    return global_mean((engine - batch.old_logp).abs(), batch.mask, reduce=reduce)


def off_policy_weights(batch: RolloutBatch, *, version: int, cap: float, max_staleness: int, reduce: Reduce,
                       reduce_max: Reduce) -> tuple[Tensor, dict[str, float]]:
    """Partial rollout: decoupled PPO's weight of each token [B, S] (off_policy.py: 1 on tokens of
    `version`, the policy whose old log-probs batch.old_logp holds) and its figures over every DP
    rank: partial/staleness_<k> (share of response tokens k versions old; the last bin counts
    max_staleness + 1 and more, which the step never trains on), partial/stale_fraction, and over
    the stale tokens partial/is_ratio_mean, _std, _min, _max (pi_prox / pi_behav before the cap),
    partial/is_weight_mean (after it) and partial/is_truncated_fraction."""
    S = batch.tokens.shape[1]
    seq = lambda rows: to_sequence(pad_ragged(rows), batch.prompt_lens, batch.response_lens, S)  # noqa: E731
    mask = batch.mask
    by = op.staleness(seq([[float(v) for v in r] for r in batch.extras["token_versions"]]), mask, version)
    stale = (by > 0) & (mask != 0)
    ratios = op.importance_ratios(batch.old_logp, seq(batch.extras["engine_logp"]), stale)
    weights = op.truncated_weights(ratios, cap)
    bins = max_staleness + 1
    sums = reduce(torch.cat([op.weight_sums(ratios, weights, stale, cap), op.staleness_counts(by, mask, bins)]))
    real = ratios[stale].double()
    extremes = reduce_max(torch.tensor([float(real.max()) if len(real) else -math.inf,
                                        -float(real.min()) if len(real) else -math.inf], dtype=torch.float64))
    n_stale, ratio_sum, weight_sum, truncated, ratio_sq = sums[:5].tolist()
    counts = sums[5:]
    logs = {f"partial/staleness_{k}": float(counts[k] / counts.sum().clamp(min=1)) for k in range(bins)}
    logs[f"partial/staleness_{bins}_or_more"] = float(counts[bins] / counts.sum().clamp(min=1))
    logs["partial/stale_fraction"] = n_stale / max(float(counts.sum()), 1.0)
    if n_stale:
        mean = ratio_sum / n_stale
        logs |= {"partial/is_ratio_mean": mean,
                 "partial/is_ratio_std": math.sqrt(max(ratio_sq / n_stale - mean * mean, 0.0)),
                 "partial/is_ratio_max": float(extremes[0]), "partial/is_ratio_min": -float(extremes[1]),
                 "partial/is_weight_mean": weight_sum / n_stale, "partial/is_truncated_fraction": truncated / n_stale}
    return torch.where(mask != 0, weights, torch.ones(())), logs


__all__ = ["Reduce", "engine_logprob_diff", "explained_variance", "global_mean", "off_policy_weights",
           "whiten_advantages"]
