"""VAPO's losses as SUMS over tokens (VAPO sec. 3, components 4-6; docs/algorithm.md).

Every function returns sums, never means: the caller divides by global counts (N response
tokens, N_pos correct-response tokens, number of responses) that it all-reduces over the
data-parallel group once per global mini-batch, which is what makes the gradient independent
of the parallel layout and the micro-batch split.

Shapes: B responses, T response positions, right-padded; ``mask`` [B, T] is 1 (or True) on
real response tokens. Padding never contributes, and NaN/inf sitting on padding cannot leak
into a result or its gradient (selections use torch.where, not multiplication).
Metric dicts hold detached 0-d float32 tensors (sums or counts), ready for an all-reduce.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor


def _real(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def policy_loss_sum(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None,
    loss_agg: Literal["token", "sample"],
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip-higher loss, summed (components 4 and 5); logp, old_logp, advantages, mask,
    weights: [B, T].

    Per token: -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A), r = exp(logp - old_logp);
    with dual_clip_c, tokens with A < 0 are further bounded by -c * A; with `weights` (no
    gradient), each token's term times its weight (decoupled PPO, off_policy.py).
    loss_agg (algo.loss_agg, component 4): "token" sums the terms over real tokens (divide by the
    global number of response tokens N to get L_PPO); "sample" is the ablation: each response's
    terms averaged over its own length first (long responses weigh as much as short ones), then
    summed over responses (divide by the global number of non-empty responses,
    normalization.GlobalCounts.responses); a response with no real token contributes 0.
    Metrics (sums/counts over tokens): tokens, clipped_tokens, clipped_low_tokens,
    clipped_high_tokens, dual_clipped_tokens (only with dual clip), approx_kl_sum (k3),
    ratio_sum; with "sample" also responses (those with at least one token).
    """
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None), got dual_clip_c={dual_clip_c}")
    if loss_agg not in ("token", "sample"):
        raise ValueError(f"loss_agg must be 'token' or 'sample', got loss_agg={loss_agg!r}")
    real = _real(mask)
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    # Mask the log-ratio before exp so padding cannot produce inf (and NaN gradients).
    log_ratio = torch.where(real, logp.float() - old_logp.float(), zero)
    ratio = torch.exp(log_ratio)
    adv = torch.where(real, advantages.float(), zero)
    unclipped = -adv * ratio
    # Clip-Higher (component 5): asymmetric range [1 - eps_low, 1 + eps_high].
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    metrics: dict[str, Tensor] = {}
    with torch.no_grad():
        clip_active = (clipped > unclipped) & real
        metrics["clipped_tokens"] = clip_active.sum().float()
        metrics["clipped_low_tokens"] = (clip_active & (ratio < 1.0 - eps_low)).sum().float()
        metrics["clipped_high_tokens"] = (clip_active & (ratio > 1.0 + eps_high)).sum().float()
    if dual_clip_c is not None:
        # Dual clip (Ye et al. 2020): for A < 0 the loss is bounded by c * |A| = -c * A, so a huge
        # ratio on a negative-advantage token cannot dominate the step.
        bound = -dual_clip_c * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual_clipped_tokens"] = (dual & real).sum().float().detach()
    if weights is not None:  # 1 on padding, so nothing there can reach the gradient
        loss = loss * torch.where(real, weights.detach().float(), torch.ones((), device=logp.device))
    loss = torch.where(real, loss, zero)  # [B, T] per-token terms, 0 on padding
    with torch.no_grad():
        # k3 estimator of KL(old || new): (r - 1) - log r >= 0, unbiased under the old policy.
        metrics["approx_kl_sum"] = torch.where(real, ratio - 1.0 - log_ratio, zero).sum()
        metrics["ratio_sum"] = torch.where(real, ratio, zero).sum()
        metrics["tokens"] = real.sum().float()
    if loss_agg == "token":
        return loss.sum(), metrics
    lengths = real.sum(dim=1)  # [B]
    per_response = loss.sum(dim=1) / lengths.clamp(min=1).to(loss.dtype)
    metrics["responses"] = (lengths > 0).sum().float()
    return per_response.sum(), metrics


def value_loss_sum(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip_range: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss summed over real tokens (token-level, like the policy loss).

    Per token: 0.5 * max((V - G)^2, (clip(V, V_old - c, V_old + c) - G)^2); without clip_range
    0.5 * (V - G)^2. Divide by the global number of response tokens. Metrics: tokens,
    clipped_tokens (the clipped term was larger), squared_error_sum (unclipped (V - G)^2).
    """
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"value clip_range must be > 0 (or None), got clip_range={clip_range}")
    real = _real(mask)
    zero = torch.zeros((), dtype=torch.float32, device=values.device)
    v = torch.where(real, values.float(), zero)
    g = torch.where(real, returns.float(), zero)
    err = (v - g) ** 2
    if clip_range is None:
        loss = err
        clipped_tokens = zero
    else:
        v_old = torch.where(real, old_values.float(), zero)
        v_clipped = v_old + (v - v_old).clamp(-clip_range, clip_range)
        err_clipped = (v_clipped - g) ** 2
        loss = torch.maximum(err, err_clipped)
        clipped_tokens = ((err_clipped > err) & real).sum().float()
    loss_sum = 0.5 * torch.where(real, loss, zero).sum()
    metrics = {
        "tokens": real.sum().float(),
        "clipped_tokens": clipped_tokens.detach(),
        "squared_error_sum": torch.where(real, err, zero).sum().detach(),
    }
    return loss_sum, metrics


def nll_loss_sum(logp: Tensor, mask: Tensor, correct: Tensor) -> Tensor:
    """Positive-example LM loss sum (component 6): -sum of logp over tokens of correct responses.

    logp, mask: [B, T]; correct: [B] bool. Divide by N_pos, the global number of tokens of
    correct responses; with no correct response the sum is 0 (and so is its gradient).
    """
    if correct.shape != logp.shape[:1]:
        raise ValueError(f"correct must have shape [B]={tuple(logp.shape[:1])}, got {tuple(correct.shape)}")
    keep = _real(mask) & correct.bool()[:, None]
    return -torch.where(keep, logp.float(), torch.zeros((), device=logp.device)).sum()


def masked_moment_sums(x: Tensor, mask: Tensor) -> Tensor:
    """[3] float64 (count, sum, sum of squares) of x over real tokens; all-reduce (SUM) it over
    the data-parallel group, then pass it to whiten()."""
    real = _real(mask)
    xd = torch.where(real, x.detach().double(), torch.zeros((), dtype=torch.float64, device=x.device))
    return torch.stack([real.sum().double(), xd.sum(), (xd * xd).sum()])


def whiten(x: Tensor, mask: Tensor, moment_sums_global: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with the GLOBAL masked mean and (unbiased) variance.

    moment_sums_global: masked_moment_sums() all-reduced over every rank and micro-batch of the
    global batch, so every rank whitens with the same statistics (docs/algorithm.md, the parallel-aware form).
    Returns float32 [B, T], 0 on padding.
    """
    count, total, total_sq = (float(v) for v in moment_sums_global)
    if count < 2:
        raise ValueError(f"whitening needs at least 2 real tokens in the global batch, got {count:.0f}")
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0) * count / (count - 1)  # Bessel, as torch.var
    out = (x.float() - mean) * (var + eps) ** -0.5
    return torch.where(_real(mask), out, torch.zeros((), device=x.device))


def explained_variance_sums(values: Tensor, returns: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Float64 sums for the critic's explained variance 1 - Var(G - V) / Var(G) over real tokens:
    count, returns_sum, returns_sq_sum, residual_sum, residual_sq_sum. All-reduce each (SUM)."""
    real = _real(mask)
    zero = torch.zeros((), dtype=torch.float64, device=values.device)
    g = torch.where(real, returns.detach().double(), zero)
    res = torch.where(real, g - values.detach().double(), zero)
    return {
        "count": real.sum().double(),
        "returns_sum": g.sum(),
        "returns_sq_sum": (g * g).sum(),
        "residual_sum": res.sum(),
        "residual_sq_sum": (res * res).sum(),
    }


def explained_variance_from_sums(sums: dict[str, Tensor]) -> float:
    """1 - Var(G - V) / Var(G) (population variances); NaN when Var(G) is 0 or no tokens."""
    n = float(sums["count"])
    if n == 0:
        return float("nan")
    var_g = float(sums["returns_sq_sum"]) / n - (float(sums["returns_sum"]) / n) ** 2
    var_res = float(sums["residual_sq_sum"]) / n - (float(sums["residual_sum"]) / n) ** 2
    # Var(G) of (near-)constant returns is float rounding noise (returns = A + V is computed in
    # float32); the ratio would be meaningless, so report NaN as for an exactly constant G.
    if var_g <= 1e-8 * max(1.0, (float(sums["returns_sum"]) / n) ** 2):
        return float("nan")
    return 1.0 - var_res / var_g
