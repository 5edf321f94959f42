"""Figures of a step over every data-parallel rank: sums and means of per-token quantities, the
critic's explained variance, and advantage whitening with global statistics (docs/algorithm.md,
the parallel-aware form). Each is one all-reduce over the DP group of a few float64 numbers."""

from __future__ import annotations

import math

import torch

from vapo_megatron.algorithms.losses import (explained_variance_from_sums, explained_variance_sums,
                                             masked_moment_sums, whiten)
from vapo_megatron.data.batch import RolloutBatch, pad_ragged, to_sequence
from vapo_megatron.data.microbatch import padding_ratio, plan_micro_batches
from vapo_megatron.mcore import parallel


def _dp_sum(t: torch.Tensor) -> torch.Tensor:
    if parallel.dp_size() > 1:
        parallel.all_reduce(t, group=parallel.dp_group())
    return t


def global_sum(value: float) -> float:
    return float(_dp_sum(torch.tensor([value], dtype=torch.float64)))


def global_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of x over the masked positions of every DP rank's batch."""
    t = _dp_sum(torch.tensor([float((x * mask).sum()), float(mask.sum())], dtype=torch.float64))
    return float(t[0] / t[1].clamp(min=1))


def whiten_advantages(batch: RolloutBatch) -> torch.Tensor:
    """Advantages whitened with the mean and variance over all response tokens of the global batch."""
    return whiten(batch.advantages, batch.mask, _dp_sum(masked_moment_sums(batch.advantages, batch.mask).double()))


def explained_variance(batch: RolloutBatch) -> float:
    """critic/explained_variance = 1 - Var(G - V) / Var(G) over all response tokens (global)."""
    sums = explained_variance_sums(batch.values, batch.returns, batch.mask)
    keys = sorted(sums)
    vec = _dp_sum(torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64))
    ev = explained_variance_from_sums(dict(zip(keys, vec)))
    return float(ev) if math.isfinite(float(ev)) else float("nan")


def engine_logprob_diff(batch: RolloutBatch) -> float:
    """Mean |engine log-prob - trainer log-prob| over response tokens: the rollout/trainer
    mismatch (kernels, precision) that recomputing old log-probs protects PPO from."""
    engine = to_sequence(pad_ragged(batch.extras["engine_logp"]), batch.prompt_lens, batch.response_lens,
                         batch.tokens.shape[1])
    return global_mean((engine - batch.old_logp).abs(), batch.mask)


def batch_padding_ratio(batch: RolloutBatch, max_tokens: int) -> float:
    """Padding share of this rank's micro-batches (perf/padding_ratio)."""
    lengths = batch.seq_lens.tolist()
    return padding_ratio(plan_micro_batches(lengths, max_tokens), lengths)


__all__ = ["batch_padding_ratio", "engine_logprob_diff", "explained_variance", "global_mean", "global_sum",
           "whiten_advantages"]
