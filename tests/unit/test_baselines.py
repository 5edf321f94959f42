"""The value-free baselines' pure parts against naive references: GRPO's group-relative
advantages, DAPO's overlong shaping and dynamic sampling's fill rule (hand-worked)."""

import random
import statistics

import pytest
import torch

from vapo_megatron.algorithms.advantages import ESTIMATORS, group_relative_advantages
from vapo_megatron.config import AlgoConfig
from vapo_megatron.data.batch import RolloutBatch, pack_sequences
from vapo_megatron.rewards.shaping import OverlongShaping
from vapo_megatron.rollout.dynamic_sampling import deal, fill, informative_groups


def naive_grpo(rewards: list[float], groups: list[int], *, std_norm: bool, eps: float) -> list[float]:
    """Per sample, a Python loop over its group: (r - mean) / (sample std + eps); a group of one has
    no spread to compare with: 0."""
    out = []
    for r, g in zip(rewards, groups):
        mine = [x for x, h in zip(rewards, groups) if h == g]
        if len(mine) == 1:
            out.append(0.0)
            continue
        dev = r - statistics.fmean(mine)
        out.append(dev / (statistics.stdev(mine) + eps) if std_norm else dev)
    return out


@pytest.mark.parametrize("std_norm", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_group_relative_advantages_equal_a_naive_loop(std_norm, seed):
    rng = random.Random(seed)
    rewards, groups = [], []
    labels = rng.sample(range(100), 12)  # any integer labels, in any order
    for g in labels:
        size = rng.choice([1, 1, 2, 4, 8])  # groups of one included
        kind = rng.random()
        for _ in range(size):
            if kind < 0.25:  # single-valued (all right or all wrong)
                rewards.append(1.0)
            elif kind < 0.6:  # binary with ties
                rewards.append(rng.choice([-1.0, 1.0]))
            else:  # continuous, with a repeated value
                rewards.append(rng.choice([round(rng.uniform(-2, 2), 3), 0.5]))
            groups.append(g)
    order = list(range(len(rewards)))
    rng.shuffle(order)  # members of a group need not be adjacent
    rewards, groups = [rewards[i] for i in order], [groups[i] for i in order]
    got = group_relative_advantages(torch.tensor(rewards), torch.tensor(groups), std_norm=std_norm, eps=1e-6)
    want = naive_grpo(rewards, groups, std_norm=std_norm, eps=1e-6)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-6)


def test_grpo_single_valued_groups_and_groups_of_one_get_zero():
    adv = group_relative_advantages(torch.tensor([1.0, 1.0, 1.0, -1.0, 3.0]), torch.tensor([0, 0, 0, 1, 2]),
                                    std_norm=True, eps=1e-6)
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]


def test_grpo_estimator_puts_the_response_value_on_every_response_token():
    tokens, pl, rl = pack_sequences([[5, 6], [5, 6], [7], [7]], [[1, 2, 3], [1], [4, 4], [9, 9, 9, 9]])
    batch = RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=torch.tensor([1.0, -1.0, 1.0, 1.0]),
                         correct=torch.tensor([True, False, True, True]), group_ids=torch.tensor([0, 0, 1, 1]))
    adv, returns, logs = ESTIMATORS["grpo"](batch, AlgoConfig(estimator="grpo"), value_pretrain=False)
    assert returns is None and logs == {}
    per = group_relative_advantages(batch.rewards, batch.group_ids, std_norm=True, eps=1e-6)
    torch.testing.assert_close(adv, per[:, None] * batch.mask)
    assert float(adv[0].abs().sum()) > 0 and float(adv[2:].abs().sum()) == 0.0  # group 1 is single-valued


def test_overlong_shaping_against_the_formula():
    shape = OverlongShaping(max_new_tokens=20, buffer=5, penalty=2.0)
    lens = list(range(0, 21))
    got = shape(torch.tensor(lens)).tolist()
    for n, p in zip(lens, got):
        want = 0.0 if n <= 15 else -2.0 * (n - 15) / 5
        assert p == pytest.approx(want), n
    assert got[-1] == pytest.approx(-2.0)  # truncated: the whole penalty
    assert OverlongShaping(max_new_tokens=20, buffer=0, penalty=2.0)(torch.tensor(lens)).abs().sum() == 0


def test_informative_groups():
    # groups 0: right+wrong, 1: all right, 2: one sample, 3: no samples, 4: all wrong
    assert informative_groups([1, -1, 1, 1, 1, -1, -1], [0, 0, 1, 1, 2, 4, 4], 5) == [True, False, False, False, False]


def test_fill_rule_hand_worked():
    # Target 4 groups, 3 per round. Round 0: groups 0 and 2 informative; round 1: 1 and 2;
    # round 2: 0, 1, 2. The step keeps (0,0), (0,2), (1,1), (1,2): the first four in order,
    # and round 2's are surplus.
    flags = [[True, False, True], [False, True, True], [True, True, True]]
    kept, topped = fill(flags, target=4, floor=2)
    assert kept == [(0, 0), (0, 2), (1, 1), (1, 2)] and topped == 0


def test_fill_rule_round_cap_trains_on_what_there_is_and_tops_up_to_one_group_per_mini_batch():
    flags = [[False, True, False], [False, False, False]]  # 2 rounds (the cap), one informative group
    kept, topped = fill(flags, target=3, floor=1)
    assert kept == [(0, 1)] and topped == 0  # enough for the floor: what there is
    kept, topped = fill(flags, target=3, floor=3)  # e.g. 3 DP ranks x 1 mini-batch
    assert kept == [(0, 1), (1, 0), (1, 1)] and topped == 2  # the last round's dropped groups, in order


def test_deal_equal_contiguous_shares():
    items = list(range(7))
    shares = [deal(items, 3, i) for i in range(3)]
    assert sum(shares, []) == items
    assert sorted(len(s) for s in shares) == [2, 2, 3]
