"""The estimators' records (config/estimators.py) against their functions, and the batch-mean
estimator against a hand computation and a Python loop, over uneven data-parallel ranks."""

import statistics

import pytest
import torch

from tests.helpers.dist_utils import run_ranks
from vapo_megatron.algorithms import advantages
from vapo_megatron.algorithms.advantages import batch_relative_advantages
from vapo_megatron.config import AlgoConfig, Config, RolloutConfig
from vapo_megatron.config.checks import config_problems, estimator_problems, unused_settings
from vapo_megatron.config.estimators import ESTIMATORS, estimator_of


def test_every_estimator_has_a_record_and_a_function():
    assert set(ESTIMATORS) == {"gae", "grpo", "batch"}
    for e in ESTIMATORS.values():
        assert all(hasattr(AlgoConfig(), k.removeprefix("algo.")) for k in e.keys), e
        assert e.function() is getattr(advantages, f"{e.name}_estimator"), e


def test_batch_estimator_equals_a_hand_computation():
    # rewards 1, -1, -1, 1, 1: mean 0.2; sample variance (4 * 0.64 ... ) = sum((r - 0.2)^2) / 4
    # = (0.64*3 + 1.44*2) / 4 = 1.2
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    adv, mean, std = batch_relative_advantages(rewards, lambda t: t, eps=0.0)
    assert mean == pytest.approx(0.2) and std == pytest.approx(1.2 ** 0.5)
    assert adv.tolist() == pytest.approx([0.8 / 1.2 ** 0.5, -1.2 / 1.2 ** 0.5, -1.2 / 1.2 ** 0.5, 0.8 / 1.2 ** 0.5,
                                          0.8 / 1.2 ** 0.5], rel=1e-6)
    same, _, _ = batch_relative_advantages(torch.tensor([1.0, 1.0, 1.0]), lambda t: t, eps=1e-6)
    assert same.tolist() == [0.0, 0.0, 0.0]  # all equal: nothing to learn
    one, _, _ = batch_relative_advantages(torch.tensor([1.0]), lambda t: t, eps=1e-6)
    assert one.tolist() == [0.0]


def test_batch_estimator_puts_one_value_on_every_response_token():
    from vapo_megatron.data.batch import RolloutBatch, pack_sequences

    tokens, pl, rl = pack_sequences([[1, 2], [3], [4, 5, 6]], [[7, 8, 9], [10], [11, 12]])
    batch = RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=torch.tensor([1.0, -1.0, 1.0]),
                         correct=torch.tensor([True, False, True]), group_ids=torch.tensor([0, 1, 2]))
    mask = batch.mask
    adv, returns, logs = ESTIMATORS["batch"].function()(batch, AlgoConfig(estimator="batch"), value_pretrain=False,
                                                dp_sum=lambda t: t)
    assert returns is None and logs["actor/batch_reward_mean"] == pytest.approx(1 / 3)
    expect = [(r - 1 / 3) / (statistics.stdev([1.0, -1.0, 1.0]) + 1e-6) for r in (1.0, -1.0, 1.0)]
    for i in range(3):
        on = mask[i] != 0
        assert torch.allclose(adv[i][on], torch.full((int(on.sum()),), expect[i]), atol=1e-6)
        assert (adv[i][~on] == 0).all()


def _two_ranks(rewards_per_rank):
    import torch.distributed as dist

    from vapo_megatron.mcore import dp_stats, parallel

    parallel.init_distributed(1, 1, None, seed=0)
    mine = torch.tensor(rewards_per_rank[dist.get_rank()])
    return batch_relative_advantages(mine, dp_stats.dp_sum, eps=1e-6)[0].tolist()


def test_batch_statistics_are_global_over_uneven_dp_ranks():
    """Rank 0 holds 3 responses, rank 1 five: each response's advantage is the one a single process
    computes over all eight (a per-rank mean would differ: rank 0's rewards are mostly wrong)."""
    per_rank = [[-1.0, -1.0, 1.0], [1.0, 1.0, -1.0, 1.0, 1.0]]
    got = run_ranks(2, _two_ranks, per_rank)
    everyone = per_rank[0] + per_rank[1]
    m, s = statistics.fmean(everyone), statistics.stdev(everyone)
    assert got[0] + got[1] == pytest.approx([(r - m) / (s + 1e-6) for r in everyone], rel=1e-6)


def test_the_checks_ask_the_record():
    one = Config(algo=AlgoConfig(estimator="batch", value_pretrain_steps=0), rollout=RolloutConfig(n_samples=1))
    assert estimator_problems(one) == [] and not estimator_of(one).needs_critic
    assert "algo.lambda_critic" in unused_settings(one)
    grpo1 = Config(algo=AlgoConfig(estimator="grpo", value_pretrain_steps=0), rollout=RolloutConfig(n_samples=1))
    assert any("rollout.n_samples=1 with algo.estimator=grpo trains nothing" in p for p in estimator_problems(grpo1))
    pretrain = Config(algo=AlgoConfig(estimator="batch", value_pretrain_steps=3))
    assert any("algo.value_pretrain_steps=3 needs a critic, which algo.estimator=batch" in p
               for p in config_problems(pretrain, check_paths=False))
    eps = Config(algo=AlgoConfig(estimator="batch", value_pretrain_steps=0, batch_std_eps=0.0))
    assert "algo.batch_std_eps=0.0 must be > 0" in estimator_problems(eps)


def test_the_critics_own_settings_are_checked_and_refused_without_a_critic():
    from vapo_megatron.config.schema import CriticConfig

    zero = Config(critic=CriticConfig(updates_per_step=0))
    assert "critic.updates_per_step=0 must be >= 1" in config_problems(zero, check_paths=False)
    grpo = Config(algo=AlgoConfig(estimator="grpo", value_pretrain_steps=0), critic=CriticConfig(updates_per_step=2))
    assert ("critic (the critic's own settings) is set, but algo.estimator=grpo has no critic: "
            "remove it from the config" in estimator_problems(grpo))
