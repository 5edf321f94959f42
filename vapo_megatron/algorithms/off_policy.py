"""Partial rollout's off-policy correction, as pure functions of tensors (decoupled PPO).

A carried-over response holds tokens sampled by older weights than the policy being trained. PPO's
ratio stays against the recomputed old log-probs (pi_prox, the proximal policy: the weights at the
step's start, mcore/actor.py log_probs) and each stale token's loss term is weighted by the
truncated importance ratio of that policy to the behaviour policy that sampled it:

    w_t = min(pi_prox(a_t) / pi_behav(a_t), cap)   for a token of an older weight version
    w_t = 1                                         for a token of the current version

(Hilton et al. 2021, "Batch size-invariance for policy optimization"; as AReaL's decoupled loss,
truncated as in verl's TIS). A current-version token keeps weight exactly 1: its pi_behav is the
engine's log-prob of the same weights, and the engine/trainer mismatch is what recomputing the old
log-probs already handles (rollout/logprob_diff). The weights depend on no parameter, so a loss
weighted by them is still a sum over tokens divided by the same global N (losses.py): exact across
DP ranks and micro-batches. All tensors are [B, S] at prediction positions (data/batch.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def staleness(versions: Tensor, mask: Tensor, current: int) -> Tensor:
    """int64 [B, S]: how many versions before `current` each real token was sampled (0 elsewhere)."""
    real = mask != 0
    return torch.where(real, current - versions.round().long(), torch.zeros((), dtype=torch.long))


def importance_ratios(prox_logp: Tensor, behav_logp: Tensor, stale: Tensor) -> Tensor:
    """float32 [B, S]: pi_prox / pi_behav on stale tokens, 1 elsewhere (exp of a masked difference:
    padding never makes inf)."""
    zero = torch.zeros((), dtype=torch.float32)
    return torch.exp(torch.where(stale, prox_logp.float() - behav_logp.float(), zero))


def truncated_weights(ratios: Tensor, cap: float) -> Tensor:
    """min(ratio, cap): a token whose behaviour probability was far below its proximal one cannot
    dominate the step (the weight is an estimate's variance bound, not a gradient path)."""
    if not cap >= 1:
        raise ValueError(f"the importance-weight cap must be >= 1, got {cap}")
    return ratios.clamp(max=cap)


def weight_sums(ratios: Tensor, weights: Tensor, stale: Tensor, cap: float) -> Tensor:
    """float64 [5]: stale tokens, sum of ratios, sum of weights, tokens truncated by `cap`, sum of
    squared ratios, over the stale tokens; all-reduce (SUM) for the global figures."""
    zero = torch.zeros((), dtype=torch.float64)
    r, w = torch.where(stale, ratios.double(), zero), torch.where(stale, weights.double(), zero)
    return torch.stack([stale.sum().double(), r.sum(), w.sum(), (stale & (ratios > cap)).sum().double(), (r * r).sum()])


def staleness_counts(stale_by: Tensor, mask: Tensor, bins: int) -> Tensor:
    """float64 [bins + 1]: real tokens by staleness 0 .. bins - 1, and bins or more in the last."""
    real = mask != 0
    return torch.bincount(stale_by[real].clamp(max=bins), minlength=bins + 1).double()


__all__ = ["importance_ratios", "staleness", "staleness_counts", "truncated_weights", "weight_sums"]
