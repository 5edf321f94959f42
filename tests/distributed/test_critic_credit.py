"""The critic path end to end on a task whose credit is unambiguous (issue 31's question: is the
critic's weak credit assignment on the chain task a bug in the critic path?).

Every response is 12 tokens; in half of them one "poison" token sits at a random position k, and
the reward is -1 with it, +1 without (terminal, as on the chain task). The real critic (megatron
model with its value head, mcore/critic.py's values and clipped value-loss update, Monte-Carlo
returns from the trainer's own GAE, algorithms/advantages.py) trains on fresh batches. Then, on
held-out rows, V_t (the value of the state before token t) must know the poison only once it is
in the state: V_{k+1} low, V_k not, so the TD error delta_t = V_{t+1} - V_t (delta_T = R - V_T)
is most negative exactly at t = k, the poison's own index. A value mask or alignment off by one
(values at the wrong positions, returns shifted, the reward at the wrong token) moves that
minimum off k, and a value head that does not learn leaves no minimum at all."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.dist_utils import run_ranks

POISON, R, P = 7, 12, 4  # the poison token, the response length, the prompt length


def _rows(g: torch.Generator, n: int):
    from vapo_megatron.data.batch import RolloutBatch, pack_sequences

    prompts = [torch.randint(20, 60, (P,), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(20, 60, (R,), generator=g).tolist() for _ in range(n)]
    ks = []
    for i in range(n):
        k = int(torch.randint(1, R - 2, (1,), generator=g)) if i % 2 else -1
        if k >= 0:
            responses[i][k] = POISON
        ks.append(k)
    tokens, pl, rl = pack_sequences(prompts, responses)
    rewards = torch.tensor([-1.0 if k >= 0 else 1.0 for k in ks])
    batch = RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=rewards, correct=rewards > 0,
                         group_ids=torch.arange(n))
    return batch, ks


def _train_and_probe():
    from model_providers import family_for
    from model_providers.presets import preset
    from vapo_megatron.config import OptimConfig
    from vapo_megatron.config.estimators import ESTIMATORS
    from vapo_megatron.config.schema import AlgoConfig
    from vapo_megatron.data.batch import to_response
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.critic import Critic
    from vapo_megatron.mcore.model import TrainModel, wrap_ddp
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.mcore.optimizer import build_optimizer
    from vapo_megatron.mcore.update import UpdateSettings

    parallel.init_distributed(1, 1, seed=0)
    hf = preset("tiny-qwen2")
    chunks = wrap_ddp(build_chunks(hf, params_dtype=torch.float32, critic=True, on_gpu=False),
                      distributed_optimizer=False)
    optim = OptimConfig(lr=3e-3, clip_grad=1.0)
    model = TrainModel(chunks=chunks, optimizer=build_optimizer(chunks, optim, params_dtype=torch.float32),
                       scheduler=None, family=family_for(hf), hf_cfg=hf, hf_dir=Path("."), critic=True, dtype="float32")
    critic = Critic(model, clip_range=None, update=UpdateSettings(mini_batches=2, epochs=1, max_tokens=4096,
                                                                   max_consecutive_skips=1))
    algo = AlgoConfig(lambda_critic=1.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):  # the trainer's steps 4-6 for the critic: values, returns, update
        batch, _ = _rows(g, 64)
        batch.values = critic.values(batch)
        _, batch.returns, _ = ESTIMATORS["gae"].function()(batch, algo, value_pretrain=False, dp_sum=lambda t: t)
        critic.update(batch, value_pretrain=False)
    batch, ks = _rows(g, 64)
    values = to_response(critic.values(batch), batch.prompt_lens, batch.response_lens)  # [B, R]: V_0 .. V_{R-1}
    return values, ks, batch.rewards


def test_the_critic_blames_the_token_that_decides_the_reward():
    ((values, ks, rewards),) = run_ranks(1, _train_and_probe)
    nxt = torch.cat([values[:, 1:], rewards.unsqueeze(1)], dim=1)  # V_{t+1}, and R after the last token
    delta = nxt - values  # [B, R] TD errors, gamma = 1, reward only at the end
    poisoned = [i for i, k in enumerate(ks) if k >= 0]
    at_k = [int(delta[i].argmin()) == ks[i] for i in poisoned]
    assert sum(at_k) >= 0.9 * len(poisoned), [(ks[i], int(delta[i].argmin())) for i in poisoned]
    # After the poison the state is known to be lost (its return is -1 whatever follows); a clean
    # row that has passed every position the poison could take ends well above it.
    after = torch.stack([values[i, ks[i] + 1:].mean() for i in poisoned])
    assert after.mean() < -0.7, after
    clean = [i for i, k in enumerate(ks) if k < 0]
    assert values[clean, -1].mean() > after.mean() + 1.0, values[clean, -1]
