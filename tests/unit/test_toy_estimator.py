"""A registered estimator is treated by its record everywhere (issue 64): a toy leave-one-out
estimator (RLOO's baseline: the mean reward of the group's other answers), value-free and needing
groups of two, is accepted by the config checks with its own refusals, sized by vapo-plan without a
critic, and given by the trainer's pieces no critic and its own function. Nothing but this file
and its record knows its name."""

from __future__ import annotations

import pytest
import torch

from vapo_megatron.config import AlgoConfig, Config, RolloutConfig
from vapo_megatron.config.checks import config_problems, estimator_problems, unused_settings
from vapo_megatron.config.estimators import ESTIMATORS, Estimator, estimator_of, register

TOY = Estimator("toy_rloo", needs_critic=False, min_group=2, keys=(), summary="leave-one-out group baseline (test)",
                fn=f"{__name__}:leave_one_out")


def leave_one_out(batch, algo, *, value_pretrain, dp_sum):
    """[B, S] advantages: each reward minus the mean of its group's other rewards; no returns."""
    r, g = batch.rewards.double(), batch.group_ids
    same = (g[:, None] == g[None, :]).double()
    others = (same @ r - r) / (same.sum(1) - 1).clamp(min=1)
    return ((r - others).float().unsqueeze(1) * batch.mask), None, {}


@pytest.fixture
def toy():
    register(TOY)
    yield TOY
    del ESTIMATORS[TOY.name]


def _cfg(**algo):
    return Config(algo=AlgoConfig(estimator="toy_rloo", value_pretrain_steps=0, **algo),
                  rollout=RolloutConfig(n_samples=4))


def test_the_config_checks_ask_the_toys_record(toy):
    assert estimator_problems(_cfg()) == []
    assert "algo.lambda_critic" in unused_settings(_cfg())  # no critic: the critic's settings are not the run's
    one = Config(algo=AlgoConfig(estimator="toy_rloo", value_pretrain_steps=0), rollout=RolloutConfig(n_samples=1))
    assert any("rollout.n_samples=1 with algo.estimator=toy_rloo trains nothing" in p and "n_samples >= 2" in p
               for p in estimator_problems(one))
    pretrain = Config(algo=AlgoConfig(estimator="toy_rloo", value_pretrain_steps=2), rollout=RolloutConfig(n_samples=4))
    assert any("algo.value_pretrain_steps=2 needs a critic, which algo.estimator=toy_rloo does not have" in p
               for p in config_problems(pretrain, check_paths=False))
    # grpo's own setting does nothing here: refused, naming the estimator that reads it.
    assert "algo.grpo_std_eps is set, but only algo.estimator=grpo reads it (this run's is toy_rloo): remove it " \
           "from the config" in estimator_problems(_cfg(grpo_std_eps=0.5))


def test_an_unknown_estimator_is_refused_naming_the_key():
    bad = Config(algo=AlgoConfig(estimator="rloo"))
    assert estimator_problems(bad) == ["algo.estimator='rloo' is not an estimator; one of: gae, grpo, batch "
                                       "(config/estimators.py)"]
    with pytest.raises(ValueError, match="algo.estimator='rloo' is not an estimator"):
        estimator_of(bad)
    with pytest.raises(ValueError, match="already registered"):
        register(ESTIMATORS["gae"])


def test_vapo_plan_sizes_the_toy_without_a_critic(toy):
    from model_providers.presets import preset
    from vapo_megatron.sizing.plan import make_plan

    hf = preset("tiny-qwen2")
    plans = {name: make_plan(Config(algo=AlgoConfig(estimator=name, value_pretrain_steps=0),
                                    rollout=RolloutConfig(n_samples=4)), hf, hf, world_size=2, gpu_memory_gib=80.0)
             for name in ("toy_rloo", "grpo", "gae")}
    assert plans["toy_rloo"].checkpoint == plans["grpo"].checkpoint < plans["gae"].checkpoint
    assert [r.__dict__ for r in plans["toy_rloo"].ranks] == [r.__dict__ for r in plans["grpo"].ranks]


def test_the_trainer_builds_no_critic_and_runs_the_toys_function(toy):
    from vapo_megatron.data.batch import RolloutBatch, pack_sequences
    from vapo_megatron.mcore.critic import NoCritic, build_critic

    cfg = _cfg()
    assert isinstance(build_critic(cfg, None), NoCritic)  # before any model is built: no value model at all
    estimate = estimator_of(cfg).function()  # what Trainer.__init__ takes as its step 5
    assert estimate is leave_one_out
    tokens, pl, rl = pack_sequences([[1]] * 4, [[2, 3]] * 4)
    batch = RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=torch.tensor([1.0, -1.0, 1.0, 1.0]),
                         correct=torch.tensor([True, False, True, True]), group_ids=torch.tensor([0, 0, 1, 1]))
    adv, returns, _ = estimate(batch, cfg.algo, value_pretrain=False, dp_sum=lambda t: t)
    assert returns is None and adv[0][batch.mask[0] != 0].tolist() == [2.0, 2.0] and float(adv[2].abs().sum()) == 0
