"""compute_gae against a per-response Python loop written from the definitions in VAPO.md."""

import pytest
import torch

from vapo_megatron.algorithms.gae import compute_gae, length_adaptive_lambda


def naive_gae(rewards, values, lengths, gamma, lams):
    """Per response, per token, in float64: delta_t = r_t + gamma V_{t+1} - V_t (V_{|o|+1} = 0),
    A_t = sum_k (gamma lam)^k delta_{t+k}; returns G_t = A_t + V_t; zeros on padding."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        r = [float(x) for x in rewards[b, :n]]
        v = [float(x) for x in values[b, :n]] + [0.0]
        delta = [r[t] + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(n):
            adv[b, t] = sum((gamma * float(lams[b])) ** k * delta[t + k] for k in range(n - t))
    ret = adv.clone()
    for b in range(B):
        n = int(lengths[b])
        ret[b, :n] += values[b, :n].double()
    return adv, ret


def make_batch(lengths, T, seed=0, garbage=True):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    lengths = torch.tensor(lengths)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    if garbage:  # padding must not matter, even when it holds junk
        rewards[~mask] = 1e6
        values[~mask] = float("nan")
    return rewards, values, mask, lengths


# Lengths cover 1, full length (T), one past a chunk boundary (65), and empty.
LENGTHS = [1, 150, 64, 65, 3, 0, 130, 17]
T = 150


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95, 1.0])
@pytest.mark.parametrize("gamma", [1.0, 0.99])
def test_matches_naive_loop(lam, gamma):
    rewards, values, mask, lengths = make_batch(LENGTHS, T)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = naive_gae(rewards, values, lengths, gamma, [lam] * len(LENGTHS))
    assert adv.dtype == ret.dtype == torch.float32 and adv.shape == (len(LENGTHS), T)
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-5, atol=1e-5)
    assert not adv[~mask].any() and not ret[~mask].any()


def test_per_response_lambdas():
    rewards, values, mask, lengths = make_batch(LENGTHS, T, seed=1)
    lams = torch.tensor([0.0, 0.99, 0.5, 1.0, 0.3, 0.7, 0.95, 0.0])
    adv, ret = compute_gae(rewards, values, mask, 1.0, lams)
    ref_adv, ref_ret = naive_gae(rewards, values, lengths, 1.0, lams.tolist())
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-5, atol=1e-5)


def test_long_response_lambda_near_one_is_stable():
    # One chunked scan over 3000 positions with g = 0.9999: compares with the float64 loop.
    T_long = 3000
    rewards, values, mask, lengths = make_batch([T_long, 2999, 1], T_long, seed=2, garbage=False)
    lams = torch.tensor([0.9999, 1.0, 0.5])
    adv, _ = compute_gae(rewards, values, mask, 1.0, lams)
    # A vectorized float64 reverse loop (the naive one is quadratic): same definition.
    ref = torch.zeros(3, T_long, dtype=torch.float64)
    for b in range(3):
        n = int(lengths[b])
        v = torch.cat([values[b, :n].double(), torch.zeros(1, dtype=torch.float64)])
        delta = rewards[b, :n].double() + v[1:] - v[:-1]
        acc = 0.0
        for t in range(n - 1, -1, -1):
            acc = float(delta[t]) + float(lams[b]) * acc
            ref[b, t] = acc
    torch.testing.assert_close(adv.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


def test_lambda_one_gamma_one_gives_monte_carlo_returns():
    # Rewards only on the last token: every token's return is the final reward (VAPO sec. 3).
    lengths = torch.tensor([5, 1, 9, 9])
    T9 = 9
    mask = torch.arange(T9)[None, :] < lengths[:, None]
    final = torch.tensor([1.0, -1.0, 0.0, 1.0])
    rewards = torch.zeros(4, T9)
    rewards[torch.arange(4), lengths - 1] = final
    values = torch.randn(4, T9)
    _, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    expected = torch.where(mask, final[:, None].expand(4, T9), torch.zeros(()))
    torch.testing.assert_close(ret, expected, rtol=0, atol=1e-6)


def test_length_adaptive_lambda():
    lengths = torch.tensor([0, 1, 20, 21, 40, 100, 8192])
    lam = length_adaptive_lambda(lengths, alpha=0.05)
    expected = torch.tensor([0.0, 0.0, 0.0, 1 - 1 / 1.05, 0.5, 0.8, 1 - 1 / 409.6])
    torch.testing.assert_close(lam, expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(lengths, alpha=0.0)


def test_bad_inputs_are_named():
    rewards, values, mask, _ = make_batch([3, 2], 4)
    holey = mask.clone()
    holey[1, 3] = True
    with pytest.raises(ValueError, match="row 1"):
        compute_gae(rewards, values, holey, 1.0, 0.9)
    # A hole past the first block of rows (they are checked 64 at a time), in a float mask.
    rewards, values, mask, _ = make_batch([5] * 130, 8)
    holey = mask.float()
    holey[100, 6] = 1.0
    with pytest.raises(ValueError, match="row 100 has a 0 before a 1"):
        compute_gae(rewards, values, holey, 1.0, 0.9)
    with pytest.raises(ValueError, match="lam"):
        compute_gae(rewards, values, mask, 1.0, 1.5)
    with pytest.raises(ValueError, match="shape"):
        compute_gae(rewards, values[:, :3], mask, 1.0, 0.9)


def _batch(B, T, lengths):
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # a float mask, as compute_advantages passes
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = 1.0
    return rewards, torch.randn(B, T, generator=torch.Generator().manual_seed(3)), mask


def test_allocates_its_two_outputs_and_little_else():
    """issue 63: compute_gae allocated about 9.6 [B, T] float32 tensors per call (index_select, where,
    the TD errors, the padding, the bmm's output per group, and [B, T] masks), each a fresh page
    fault per page on a CPU. Now the outputs are its only allocations of a quarter of [B, T] or more,
    and everything it allocates, outputs included, stays under 2.5 [B, T]. Counted by torch's
    profiler (benchmarks/allocations.py), whose count is checked first on one known allocation."""
    from benchmarks.allocations import allocations

    B, T = 1024, 2048
    unit = B * T * 4
    _, seen = allocations(lambda: torch.zeros(B, T))
    assert [a.nbytes for a in seen] == [unit], seen
    g = torch.Generator().manual_seed(0)
    for lengths in (torch.full((B,), T),  # every response at the limit: each group spans all of T
                    torch.exp(torch.randn(B, generator=g) + 5.5).round().clamp(1, T).long()):  # long-tailed
        rewards, values, mask = _batch(B, T, lengths)
        lam = length_adaptive_lambda(lengths, alpha=0.05)
        (adv, ret), seen = allocations(lambda: compute_gae(rewards, values, mask, 1.0, lam))
        big = [a for a in seen if a.nbytes >= unit // 4]
        assert [a.nbytes for a in big] == [unit, unit], big  # advantages and returns
        assert sum(a.nbytes for a in seen) <= 2.5 * unit, sum(a.nbytes for a in seen) / unit
    # The answer is unchanged by the reuse of buffers across groups of different lengths (the
    # tests above compare with the definition; this one, more groups than one workspace's worth).
    lengths = torch.tensor([300, 1, 150, 64, 65, 0, 290, 129] * 24)
    rewards, values, mask, _ = make_batch(lengths.tolist(), 300, seed=4)
    lam = length_adaptive_lambda(lengths, alpha=0.05)
    adv, ret = compute_gae(rewards, values, mask, 0.99, lam)
    rows = torch.tensor([0, 2, 3, 4, 6, 7, 185, 190])
    ref_adv, ref_ret = naive_gae(rewards[rows], values[rows], lengths[rows], 0.99, lam[rows].tolist())
    torch.testing.assert_close(adv[rows].double(), ref_adv, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ret[rows].double(), ref_ret, rtol=1e-5, atol=1e-4)
