"""Optional supervised warm start (phase "sft") on correct examples, before RL.

The paper starts from a pretrained base model; the CPU demo starts from a random tiny model and
gets its base competence here. Rows use the simple schema with `answer` holding the complete
target response. The loss is the actor's own positive-example NLL (component 6) with every
response marked correct and zero advantages: L = -(1/N) sum log p(target tokens), through the
same schedule and normalization as the RL updates, with an optimizer of its own (Adam moments of
supervised gradients would otherwise damp the first hundreds of RL steps; beta2 = 0.999 remembers
~1000 steps). When SFT ends, the RL optimizer takes the weights over (reload_model_params) and the
critic starts from the warm-started policy's trunk (component 1, docs/algorithm.md).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from vapo_megatron.checkpoint import dist_io
from vapo_megatron.config import Config
from vapo_megatron.config.critic_start import critic_start
from vapo_megatron.data.batch import RolloutBatch, pack_sequences
from vapo_megatron.data.datasets import Datasets
from vapo_megatron.data.prompts import PromptSampler
from vapo_megatron.evaluation.sampled import greedy_accuracy
from vapo_megatron.mcore import parallel
from vapo_megatron.mcore.actor import Actor, PolicyLossSettings
from vapo_megatron.mcore.dtypes import torch_dtype
from vapo_megatron.mcore.model import TrainModel
from vapo_megatron.mcore.optimizer import build_optimizer
from vapo_megatron.mcore.update import UpdateSettings
from vapo_megatron.rewards.scorer import Scorer
from vapo_megatron.rollout.generator import Generator


def load_critic_start(cfg: Config, models: dict[str, TrainModel]) -> None:
    """Collective. critic.warm_start given as a Megatron critic checkpoint (a run's
    checkpoints/iter_N/critic): its weights into the built critic, at this run's layout (a dist
    checkpoint reshards), and the optimizer's main copies after them; for a fresh run only (a
    resume loads the run's own checkpoint instead). An HF value model was read when the critic was
    built (mcore/model.py). Nothing without a critic or a Megatron warm start."""
    start = critic_start(cfg)
    if "critic" not in models or not start.megatron:
        return
    model = models["critic"]
    with model.layout:  # loaded at the critic's layout, its own (critic.parallel) or the actor's
        dist_io.load_model(start.path, model.modules)  # weights only: the run's optimizer starts fresh
        model.optimizer.reload_model_params()


def _sft_batch(records, tokenizer, stop_id: int) -> RolloutBatch:
    prompts = [r.prompt_ids for r in records]
    responses = [tokenizer(r.answer, add_special_tokens=False)["input_ids"] + [stop_id] for r in records]
    tokens, pl, rl = pack_sequences(prompts, responses)
    n = len(records)
    batch = RolloutBatch(
        tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=torch.ones(n),
        correct=torch.ones(n, dtype=torch.bool), group_ids=torch.arange(n),
    )
    batch.old_logp = torch.zeros(tokens.shape)
    batch.advantages = torch.zeros(tokens.shape)
    return batch


def sft_steps(cfg: Config, actor: TrainModel, data: Datasets, gen: Generator, scorer: Scorer, *,
              start: int) -> Iterator[tuple[int, dict, bool]]:
    """Yields (step, logs, finished). Stops early once greedy accuracy on RL-train prompts
    reaches sft.target_accuracy: a tiny model's SFT generalizes in a sharp, seed-dependent
    transition, so a step count alone over- or under-shoots (docs/data_and_rewards.md)."""
    s, d = cfg.sft, cfg.data
    sampler = PromptSampler(data.sft, s.batch_size, d.seed + 1)
    for _ in range(start):  # deterministic position on resume
        sampler.next_batch()
    sft_optim = dataclasses.replace(cfg.actor_optim, lr=s.lr, warmup_steps=0)
    optimizer = build_optimizer(actor.chunks, sft_optim, params_dtype=torch_dtype(cfg.model.dtype))
    model = dataclasses.replace(actor, optimizer=optimizer, scheduler=None)  # same weights, its own optimizer
    settings = PolicyLossSettings(eps_low=0.2, eps_high=0.2, dual_clip_c=None, loss_agg="token",
                                  nll_coef=1.0, temperature=1.0, chunk_tokens=cfg.trainer.logprob_chunk_tokens)
    sft = Actor(model, settings, UpdateSettings(mini_batches=1, epochs=1, max_tokens=cfg.trainer.micro_batch_tokens,
                                                max_consecutive_skips=cfg.trainer.max_consecutive_skips))
    for step in range(start, s.steps):
        _, records = parallel.dp_share(sampler.next_batch())
        logs = sft.update(_sft_batch(records, data.tokenizer, scorer.stop_token_ids[0]))
        out = {"sft/nll_loss": logs["actor/nll_loss"], "sft/grad_norm": logs["actor/grad_norm"], "sft/step": step + 1}
        done = step + 1 == s.steps
        if s.target_accuracy is not None and (step + 1) % s.eval_every == 0:
            gen.sync_weights(actor, version=-1)
            out["sft/train_accuracy"] = greedy_accuracy(gen, scorer, data.train[: s.eval_prompts])
            done = done or out["sft/train_accuracy"] >= s.target_accuracy
        yield step, out, done
        if done:
            return
