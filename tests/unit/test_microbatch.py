"""Token-budget micro-batching: budget, coverage, equal counts across DP ranks, low padding."""

import numpy as np
import pytest

from vapo_megatron.data.microbatch import padded_tokens, padding_ratio, plan_micro_batches


def _long_tailed(n: int, seed: int) -> list[int]:
    # Lognormal lengths (median ~600 tokens, long tail), clipped to [16, 8192] like CoT responses.
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=6.4, sigma=1.0, size=n), 16, 8192).astype(int).tolist()


def _check_partition(mbs, lengths, max_tokens):
    flat = sorted(i for mb in mbs for i in mb)
    assert flat == list(range(len(lengths)))
    assert all(mb for mb in mbs)
    for mb in mbs:
        longest = max(lengths[i] for i in mb)
        assert longest * len(mb) <= max_tokens or len(mb) == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_tailed_padding_under_ten_percent_and_naive_is_worse(seed):
    lengths = _long_tailed(1024, seed)
    assert max(lengths) > 4096  # the tail is really there
    max_tokens = 16384
    mbs = plan_micro_batches(lengths, max_tokens)
    _check_partition(mbs, lengths, max_tokens)
    ratio = padding_ratio(mbs, lengths)
    assert ratio <= 0.10, ratio

    # Naive: fixed-size micro-batches in arrival order, the size that fits the longest sequence
    # twice (so the same budget is respected in the worst case), padded to each batch's max.
    naive_size = 2
    naive = [list(range(i, min(i + naive_size, len(lengths)))) for i in range(0, len(lengths), naive_size)]
    naive_ratio = padding_ratio(naive, lengths)
    # Even with tiny batches, arrival-order batching wastes far more than the planner;
    # with batches of 8 it is worse still.
    naive8 = [list(range(i, min(i + 8, len(lengths)))) for i in range(0, len(lengths), 8)]
    assert naive_ratio > 2 * ratio and padding_ratio(naive8, lengths) > 0.4
    # And the planner needs no more forward passes worth of padded tokens than the naive one.
    assert padded_tokens(mbs, lengths) < padded_tokens(naive8, lengths)


def test_padding_ratio_by_hand():
    lengths = [4, 2, 3, 3]
    assert padding_ratio([[0, 1], [2, 3]], lengths) == pytest.approx((8 + 6 - 12) / 14)
    assert padding_ratio([[0], [1], [2], [3]], lengths) == 0.0


def test_min_micro_batches_gives_equal_counts_across_ranks():
    # Two "DP ranks" with different token loads: plan, take the max count, plan again.
    ranks = [_long_tailed(100, 10), _long_tailed(37, 11)]
    first = [len(plan_micro_batches(lens, 8192)) for lens in ranks]
    assert first[0] != first[1]
    target = max(first)
    plans = [plan_micro_batches(lens, 8192, min_micro_batches=target) for lens in ranks]
    assert [len(p) for p in plans] == [target, target]
    for p, lens in zip(plans, ranks):
        _check_partition(p, lens, 8192)


def test_num_groups_rounds_up_and_too_few_sequences_raises():
    lengths = [10] * 7
    mbs = plan_micro_batches(lengths, 1000, num_groups=4)
    assert len(mbs) == 4
    _check_partition(mbs, lengths, 1000)
    with pytest.raises(ValueError, match="7 sequences cannot fill 8 micro-batches"):
        plan_micro_batches(lengths, 1000, min_micro_batches=8)


def test_oversized_sequence_gets_its_own_micro_batch_and_is_deterministic():
    lengths = [50, 300, 40, 60, 10]
    mbs = plan_micro_batches(lengths, 120)
    assert [1] in mbs
    _check_partition(mbs, lengths, 120)
    assert mbs == plan_micro_batches(list(lengths), 120)


def test_bad_lengths_are_named():
    with pytest.raises(ValueError, match=r"lengths\[2\]=0"):
        plan_micro_batches([3, 4, 0], 100)
