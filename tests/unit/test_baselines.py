"""The value-free baselines' pure parts against naive references: GRPO's group-relative
advantages, DAPO's overlong shaping and dynamic sampling's fill rule (hand-worked)."""

import random
import statistics

import pytest
import torch

from vapo_megatron.algorithms.advantages import group_relative_advantages, informative_groups
from vapo_megatron.config import AlgoConfig
from vapo_megatron.config.estimators import ESTIMATORS
from vapo_megatron.data.batch import RolloutBatch, pack_sequences
from vapo_megatron.rewards.shaping import OverlongShaping
from vapo_megatron.rollout.dynamic_sampling import deal, fill


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
    adv, returns, logs = ESTIMATORS["grpo"].function()(batch, AlgoConfig(estimator="grpo"), value_pretrain=False,
                                                       dp_sum=lambda t: t)
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


class _Tokens:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Engine:
    """n responses per prompt, [round seed, prompt, sample]: a Generator's collect in one process."""

    def __init__(self, n: int):
        self.n = n

    def collect(self, prompts, seed):
        from vapo_megatron.rollout.base import RolloutOutput
        from vapo_megatron.rollout.generator import Rollout

        outputs = [RolloutOutput(prompt_index=i, token_ids=[seed % 1000, i, j], finish_reason="stop")
                   for i in range(len(prompts)) for j in range(self.n)]
        return Rollout(prompts=list(prompts), outputs=outputs, n=self.n)


class _FlakyReward:
    """Every call is counted here (the reference); a third of them fail (an error, the incorrect
    score), two of them time out, and sample 0 of a group is right, so groups are mixed or not."""

    def __init__(self):
        self.calls = self.errors = self.timeouts = 0

    def __call__(self, prompts, responses, answers):
        from vapo_megatron.rewards import RewardResult

        out = []
        for text in responses:
            self.calls += 1
            seed, i, j = map(int, text.split())
            if (seed + 7 * i + j) % 3 == 0:
                self.errors += 1
                timed_out = self.timeouts < 2
                self.timeouts += timed_out
                out.append(RewardResult(score=0.0, correct=False, timed_out=timed_out, error="ValueError: boom"))
            else:
                out.append(RewardResult(score=float(j == 0), correct=j == 0))
        return out

    def close(self):
        pass


def test_dynamic_sampling_counts_every_reward_call_of_every_round(monkeypatch):
    """reward/errors and reward/timeouts under dynamic sampling are the failures of every judged
    response of the step, dropped groups included (192 failed calls were logged as the 32 of the
    kept groups), and rollout/samples_generated says how many responses that was; the counts are
    the reward function's own (one process: DP = 1)."""
    from vapo_megatron.config import RolloutConfig
    from vapo_megatron.data.prompts import PromptRecord, PromptSampler
    from vapo_megatron.mcore import parallel
    from vapo_megatron.rewards.scorer import Scorer
    from vapo_megatron.rollout.dynamic_sampling import StepRollouts

    monkeypatch.setattr(parallel, "dp_size", lambda: 1)
    monkeypatch.setattr(parallel, "dp_rank", lambda: 0)
    reward = _FlakyReward()
    scorer = Scorer(reward, _Tokens(), stop_token_ids=(0,))
    cfg = RolloutConfig(prompts_per_step=4, n_samples=2, dynamic_sampling=True, max_sampling_rounds=5)
    records = [PromptRecord(prompt_ids=[1, 2], answer="x", source=f"p:{k}", prompt_text=f"p{k}") for k in range(64)]
    sampler = PromptSampler(records, cfg.prompts_per_step, seed=0)
    rollout, sampling_logs = StepRollouts(_Engine(cfg.n_samples), scorer, cfg, mini_batches=2).collect(sampler, seed=3)
    _, reward_logs = scorer.score(rollout)
    step = {**sampling_logs, **reward_logs}  # as the trainer merges a step's parts (trainer.py _log_step)
    rounds = sampling_logs["rollout/sampling_rounds"]
    assert rounds > 1 and len(rollout.outputs) < reward.calls  # some groups were dropped
    assert step["rollout/samples_generated"] == reward.calls == rounds * 4 * 2
    assert (step["reward/errors"], step["reward/timeouts"]) == (reward.errors, 2)
    assert 0 < sum(r.error is not None for r in rollout.results) < reward.errors  # the dropped groups failed too
