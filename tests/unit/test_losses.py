"""Each loss against a direct loop over responses and tokens (float64, plain Python math)."""

import math

import pytest
import torch

from vapo_megatron.algorithms.losses import (
    explained_variance_from_sums,
    explained_variance_sums,
    masked_moment_sums,
    nll_loss_sum,
    policy_loss_sum,
    value_loss_sum,
    whiten,
)

LENGTHS = [5, 1, 8, 3, 0, 6]
T = 8


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    lengths = torch.tensor(LENGTHS)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=g) * 3
    # Ratios spread over [0.5, 2.5] so both clip sides and the dual clip are exercised.
    logp = old + torch.empty(B, T).uniform_(math.log(0.5), math.log(2.5), generator=g)
    adv = torch.randn(B, T, generator=g) * 2
    logp[~mask] = 50.0  # junk on padding must not matter
    adv[~mask] = float("nan")
    return logp, old, adv, mask


def naive_token_term(lp, olp, a, eps_low, eps_high, c):
    r = math.exp(lp - olp)
    term = -min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
    if c is not None and a < 0:
        term = min(term, -c * a)
    return term


def naive_policy(logp, old, adv, eps_low, eps_high, c, sample_level, weights=None):
    total = 0.0
    for b, n in enumerate(LENGTHS):
        terms = [naive_token_term(float(logp[b, t]), float(old[b, t]), float(adv[b, t]), eps_low, eps_high, c)
                 * (1.0 if weights is None else float(weights[b, t])) for t in range(n)]
        if sample_level:
            total += sum(terms) / n if n else 0.0
        else:
            total += sum(terms)
    return total


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dual_clip_c", [None, 1.5])
@pytest.mark.parametrize("sample_level", [False, True])
def test_policy_loss_matches_loop(dual_clip_c, sample_level, weighted):
    logp, old, adv, mask = batch()
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(7)) * 1.5 if weighted else None
    if weighted:
        weights[~mask] = float("nan")  # junk on padding must not matter
    loss, metrics = policy_loss_sum(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=dual_clip_c,
                                    loss_agg="sample" if sample_level else "token", weights=weights)
    ref = naive_policy(logp, old, adv, 0.2, 0.28, dual_clip_c, sample_level, weights)
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-5)

    n_tokens = sum(LENGTHS)
    low = high = dual = 0
    kl = ratios = 0.0
    for b, n in enumerate(LENGTHS):
        for t in range(n):
            r = math.exp(float(logp[b, t]) - float(old[b, t]))
            a = float(adv[b, t])
            low += a < 0 and r < 0.8
            high += a > 0 and r > 1.28
            kl += r - 1 - math.log(r)
            ratios += r
            if dual_clip_c is not None and a < 0:
                dual += -min(r * a, min(max(r, 0.8), 1.28) * a) > -dual_clip_c * a
    assert metrics["tokens"].item() == n_tokens
    assert metrics["clipped_low_tokens"].item() == low > 0
    assert metrics["clipped_high_tokens"].item() == high > 0
    assert metrics["clipped_tokens"].item() == low + high
    assert metrics["approx_kl_sum"].item() == pytest.approx(kl, rel=1e-5)
    assert metrics["ratio_sum"].item() == pytest.approx(ratios, rel=1e-5)
    assert ("dual_clipped_tokens" in metrics) == (dual_clip_c is not None)
    if dual_clip_c is not None:
        assert metrics["dual_clipped_tokens"].item() == dual > 0
    assert metrics.get("responses") == (sum(n > 0 for n in LENGTHS) if sample_level else None)


def test_policy_loss_refuses_an_unknown_aggregation():
    logp, old, adv, mask = batch()
    with pytest.raises(ValueError, match="loss_agg must be 'token' or 'sample', got loss_agg='seq'"):
        policy_loss_sum(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=None, loss_agg="seq")


def test_clip_higher_is_asymmetric():
    # A > 0, ratio 1.25: inside [0.8, 1.28] (clip-higher) but clipped by the symmetric 0.2.
    logp, old = torch.tensor([[math.log(1.25)]]), torch.zeros(1, 1)
    adv, mask = torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool)
    higher, _ = policy_loss_sum(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=None, loss_agg="token")
    symmetric, _ = policy_loss_sum(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip_c=None, loss_agg="token")
    assert higher.item() == pytest.approx(-1.25) and symmetric.item() == pytest.approx(-1.2)
    # A < 0, ratio 0.75: clipped at 1 - eps_low = 0.8 either way.
    low, _ = policy_loss_sum(torch.tensor([[math.log(0.75)]]), old, -adv, mask, eps_low=0.2, eps_high=0.28,
                             dual_clip_c=None, loss_agg="token")
    assert low.item() == pytest.approx(0.8)


def test_sample_level_differs_from_token_level_and_gradients_match_loop():
    logp, old, adv, mask = batch(seed=3)
    lp = logp.clone().requires_grad_()
    token, _ = policy_loss_sum(lp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=None, loss_agg="token")
    sample, _ = policy_loss_sum(lp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=None, loss_agg="sample")
    assert abs(token.item() - sample.item()) > 1e-3
    (grad_token,) = torch.autograd.grad(token, lp)
    # Direct per-token derivative: d/dlp of -A r = -A r when unclipped, 0 when clipped.
    ref = torch.zeros_like(lp)
    for b, n in enumerate(LENGTHS):
        for t in range(n):
            r = math.exp(float(logp[b, t]) - float(old[b, t]))
            a = float(adv[b, t])
            clipped = (a > 0 and r > 1.28) or (a < 0 and r < 0.8)
            ref[b, t] = 0.0 if clipped else -a * r
    torch.testing.assert_close(grad_token, ref, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(grad_token).all()


@pytest.mark.parametrize("clip_range", [None, 0.2])
def test_value_loss_matches_loop(clip_range):
    g = torch.Generator().manual_seed(4)
    _, _, _, mask = batch()
    values, old_values, returns = (torch.randn(len(LENGTHS), T, generator=g) for _ in range(3))
    values[~mask] = float("inf")
    loss, metrics = value_loss_sum(values, old_values, returns, mask, clip_range=clip_range)
    ref, clipped = 0.0, 0
    for b, n in enumerate(LENGTHS):
        for t in range(n):
            v, vo, ret = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
            e1 = (v - ret) ** 2
            if clip_range is None:
                ref += 0.5 * e1
            else:
                vc = min(max(v, vo - clip_range), vo + clip_range)
                e2 = (vc - ret) ** 2
                ref += 0.5 * max(e1, e2)
                clipped += e2 > e1
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert metrics["clipped_tokens"].item() == clipped
    if clip_range is not None:
        assert clipped > 0


def test_nll_loss_sum():
    logp, _, _, mask = batch()
    correct = torch.tensor([True, False, True, False, True, False])
    ref = -sum(float(logp[b, t]) for b, n in enumerate(LENGTHS) if correct[b] for t in range(n))
    assert nll_loss_sum(logp, mask, correct).item() == pytest.approx(ref, rel=1e-6)
    lp = logp.clone().requires_grad_()
    none = nll_loss_sum(lp, mask, torch.zeros(len(LENGTHS), dtype=torch.bool))
    none.backward()
    assert none.item() == 0.0 and not lp.grad.any()


def test_whitening_uses_global_statistics():
    logp, _, adv, mask = batch(seed=5)
    adv = torch.where(mask, torch.randn(mask.shape) * 3 + 1, torch.full(mask.shape, float("nan")))
    # Two "ranks" holding halves of the batch: summed moments equal the whole batch's.
    sums = masked_moment_sums(adv[:3], mask[:3]) + masked_moment_sums(adv[3:], mask[3:])
    out = whiten(adv[3:], mask[3:], sums)
    real = adv[mask]
    expected = (adv[3:] - real.mean()) / real.var().sqrt()
    torch.testing.assert_close(out[mask[3:]], expected[mask[3:]], rtol=1e-5, atol=1e-6)
    assert not out[~mask[3:]].any()


def test_explained_variance():
    g = torch.Generator().manual_seed(6)
    _, _, _, mask = batch()
    returns = torch.randn(mask.shape, generator=g)
    values = returns + 0.3 * torch.randn(mask.shape, generator=g)
    half = [explained_variance_sums(values[s], returns[s], mask[s]) for s in (slice(0, 2), slice(2, None))]
    sums = {k: half[0][k] + half[1][k] for k in half[0]}
    G, V = returns[mask].double(), values[mask].double()
    ref = 1 - torch.var(G - V, unbiased=False) / torch.var(G, unbiased=False)
    assert explained_variance_from_sums(sums) == pytest.approx(ref.item(), rel=1e-9)
    assert explained_variance_from_sums(explained_variance_sums(returns, returns, mask)) == pytest.approx(1.0)


def test_explained_variance_of_rounding_noise_is_nan():
    from vapo_megatron.algorithms.losses import explained_variance_from_sums, explained_variance_sums

    # Monte-Carlo returns of an all-wrong batch: constant -1 up to float32 rounding of A + V.
    values = torch.randn(4, 6)
    returns = ((-1.0 - values) + values).float()
    mask = torch.ones(4, 6)
    assert math.isnan(explained_variance_from_sums(explained_variance_sums(values, returns, mask)))


def test_sample_level_m_skips_empty_responses():
    """M (algorithms/normalization.py) counts only responses with a token, and the actor's
    sample-level scaling over two micro-batches, divided by N as finalize_model_grads does,
    equals the naive mean over non-empty responses of their token means."""
    from vapo_megatron.algorithms.normalization import GlobalCounts, count_sums
    from vapo_megatron.data.batch import RolloutBatch

    logp, old, adv, mask = batch()
    B = len(LENGTHS)
    rb = RolloutBatch(tokens=torch.zeros(B, T + 1, dtype=torch.long), prompt_lens=torch.ones(B, dtype=torch.long),
                      response_lens=torch.tensor(LENGTHS), rewards=torch.zeros(B),
                      correct=torch.zeros(B, dtype=torch.bool), group_ids=torch.zeros(B, dtype=torch.long))
    assert torch.equal(rb.mask[:, :T].bool(), mask)  # the same responses as `batch()`, prompt length 1
    counts = GlobalCounts.from_sums(count_sums(rb.mask, rb.correct))  # one rank: its sums are the totals
    assert counts.responses == sum(n > 0 for n in LENGTHS) == B - 1 and counts.tokens == sum(LENGTHS)
    total = 0.0
    for rows in ([0, 1, 2], [3, 4, 5]):  # two micro-batches, as the actor's loss sees them
        pg, _ = policy_loss_sum(logp[rows], old[rows], adv[rows], mask[rows],
                                eps_low=0.2, eps_high=0.28, dual_clip_c=None, loss_agg="sample")
        total += (pg * (counts.tokens / counts.responses)).item()
    means = []
    for b, n in enumerate(LENGTHS):
        if n:
            means.append(sum(naive_token_term(float(logp[b, t]), float(old[b, t]), float(adv[b, t]), 0.2, 0.28, None)
                             for t in range(n)) / n)
    assert total / counts.tokens == pytest.approx(sum(means) / len(means), rel=1e-5)
