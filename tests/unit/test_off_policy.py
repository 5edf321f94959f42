"""Partial rollout's off-policy correction (algorithms/off_policy.py, losses.py's weights,
algorithms/step_stats.py off_policy_weights) against plain-Python loops: with no stale token the loss is
today's bitwise; with stale tokens it is the decoupled-PPO loss of a single-process reference,
whatever the split into DP ranks and micro-batches (issue 47)."""

import math

import pytest
import torch

from vapo_megatron.algorithms import off_policy, step_stats
from vapo_megatron.algorithms.losses import policy_loss_sum
from vapo_megatron.data.batch import RolloutBatch, pack_sequences

LENGTHS = [5, 1, 8, 3, 6, 7]
T = 8
CAP = 1.5
CLIP = dict(eps_low=0.2, eps_high=0.28)


def batch(seed=0):
    """logp, prox (old) and behaviour log-probs, advantages, mask, and each token's version (the
    current one is 3; versions never decrease along a response)."""
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    prox = -torch.rand(B, T, generator=g) * 3
    logp = prox + torch.empty(B, T).uniform_(math.log(0.5), math.log(2.5), generator=g)
    behav = prox + torch.empty(B, T).uniform_(-1.0, 1.0, generator=g)
    adv = torch.randn(B, T, generator=g) * 2
    first = torch.randint(1, 4, (B, 1), generator=g)
    versions = torch.minimum(first + torch.arange(T)[None, :] // 3, torch.tensor(3))
    logp[~mask], behav[~mask], adv[~mask] = 50.0, float("nan"), float("nan")  # junk on padding must not matter
    return logp, prox, behav, adv, mask, versions


def naive_term(lp, olp, a, c):
    r = math.exp(lp - olp)
    term = -min(r * a, min(max(r, 1 - CLIP["eps_low"]), 1 + CLIP["eps_high"]) * a)
    return min(term, -c * a) if c is not None and a < 0 else term


def naive_weight(prox, behav, version, current=3):
    return 1.0 if version == current else min(math.exp(prox - behav), CAP)


def weights_of(prox, behav, mask, versions):
    stale = (off_policy.staleness(versions.float(), mask, 3) > 0) & mask
    return off_policy.truncated_weights(off_policy.importance_ratios(prox, behav, stale), CAP)


@pytest.mark.parametrize("loss_agg", ["token", "sample"])
@pytest.mark.parametrize("dual_clip_c", [None, 1.5])
def test_without_stale_tokens_the_weights_are_one_and_the_loss_is_todays_bitwise(loss_agg, dual_clip_c):
    logp, prox, behav, adv, mask, _ = batch()
    w = weights_of(prox, behav, mask, torch.full((len(LENGTHS), T), 3))
    assert torch.equal(w, torch.ones_like(w))
    runs = []
    for weights in (None, w):
        lp = logp.clone().requires_grad_()
        loss, metrics = policy_loss_sum(lp, prox, adv, mask, dual_clip_c=dual_clip_c, loss_agg=loss_agg,
                                        weights=weights, **CLIP)
        runs.append((loss, torch.autograd.grad(loss, lp)[0], metrics))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert all(torch.equal(runs[0][2][k], runs[1][2][k]) for k in runs[0][2])


@pytest.mark.parametrize("dual_clip_c", [None, 1.5])
def test_stale_tokens_give_the_single_process_loss_and_gradient_in_any_split(dual_clip_c):
    logp, prox, behav, adv, mask, versions = batch(seed=1)
    w = weights_of(prox, behav, mask, versions)
    stale = [(b, t) for b, n in enumerate(LENGTHS) for t in range(n) if int(versions[b, t]) < 3]
    assert 0 < len(stale) < sum(LENGTHS) and any(float(w[b, t]) == CAP for b, t in stale)  # some truncated
    N = sum(LENGTHS)
    ref, ref_grad = 0.0, torch.zeros(len(LENGTHS), T, dtype=torch.float64)
    for b, n in enumerate(LENGTHS):
        for t in range(n):
            wt = naive_weight(float(prox[b, t]), float(behav[b, t]), int(versions[b, t]))
            assert float(w[b, t]) == pytest.approx(wt, rel=1e-6)
            lp, olp, a = float(logp[b, t]), float(prox[b, t]), float(adv[b, t])
            ref += wt * naive_term(lp, olp, a, dual_clip_c) / N
            h = 1e-6  # the term's derivative in logp, by central differences in float64
            ref_grad[b, t] = (wt * (naive_term(lp + h, olp, a, dual_clip_c) - naive_term(lp - h, olp, a, dual_clip_c))
                              / (2 * h) / N)
    # "DP ranks" of rows {0, 3}, {1, 2, 5}, {4}, each split again into single-row "micro-batches":
    # every part's loss sum over the same global N.
    for parts in ([[0, 1, 2, 3, 4, 5]], [[0, 3], [1, 2, 5], [4]], [[r] for r in range(6)]):
        lp = logp.clone().requires_grad_()
        total = sum(policy_loss_sum(lp[rows], prox[rows], adv[rows], mask[rows], dual_clip_c=dual_clip_c,
                                    loss_agg="token", weights=w[rows], **CLIP)[0] for rows in parts) / N
        (grad,) = torch.autograd.grad(total, lp)
        assert total.item() == pytest.approx(ref, rel=1e-5, abs=1e-7)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
        assert torch.isfinite(grad).all()


def test_the_step_figures_and_weights_over_a_batch():
    """step_stats.off_policy_weights on a batch as the scorer builds it (response lists, sequence
    layout), on one rank (the reductions are the identity)."""
    _, prox_r, behav_r, _, mask_r, versions_r = batch(seed=2)
    prompts = [[5, 6, 7][: 1 + b % 3] for b in range(len(LENGTHS))]
    responses = [list(range(10, 10 + n)) for n in LENGTHS]
    tokens, pl, rl = pack_sequences(prompts, responses)
    b = RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=torch.zeros(6),
                     correct=torch.zeros(6, dtype=torch.bool), group_ids=torch.arange(6))
    S = tokens.shape[1]
    b.old_logp = torch.zeros(6, S)
    for i, n in enumerate(LENGTHS):
        b.old_logp[i, pl[i] - 1 : pl[i] - 1 + n] = prox_r[i, :n]
    b.extras["engine_logp"] = [behav_r[i, :n].tolist() for i, n in enumerate(LENGTHS)]
    b.extras["token_versions"] = [versions_r[i, :n].tolist() for i, n in enumerate(LENGTHS)]
    weights, logs = step_stats.off_policy_weights(b, version=3, cap=CAP, max_staleness=1, reduce=lambda t: t,
                                                 reduce_max=lambda t: t)
    tokens_by_age = [0, 0, 0]
    ratios, wsum = [], 0.0
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            age = 3 - int(versions_r[i, t])
            tokens_by_age[min(age, 2)] += 1
            wt = naive_weight(float(prox_r[i, t]), float(behav_r[i, t]), int(versions_r[i, t]))
            assert float(weights[i, pl[i] - 1 + t]) == pytest.approx(wt, rel=1e-6)
            if age:
                ratios.append(math.exp(float(prox_r[i, t]) - float(behav_r[i, t])))
                wsum += wt
    assert float((weights * (b.mask == 0)).sum()) == float((b.mask == 0).sum())  # 1 off the response tokens
    N = sum(LENGTHS)
    assert logs["partial/staleness_0"] == pytest.approx(tokens_by_age[0] / N)
    assert logs["partial/staleness_1"] == pytest.approx(tokens_by_age[1] / N)
    assert logs["partial/staleness_2_or_more"] == pytest.approx(tokens_by_age[2] / N)
    assert logs["partial/stale_fraction"] == pytest.approx(len(ratios) / N)
    assert logs["partial/is_ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    assert logs["partial/is_ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
    assert logs["partial/is_ratio_min"] == pytest.approx(min(ratios), rel=1e-5)
    assert logs["partial/is_weight_mean"] == pytest.approx(wsum / len(ratios), rel=1e-5)
    assert logs["partial/is_truncated_fraction"] == pytest.approx(sum(r > CAP for r in ratios) / len(ratios))
