"""Optional supervised warm start (phase "sft") on correct examples, before RL.

The paper starts from a pretrained base model; the CPU demo starts from a random tiny model and
gets its base competence here. Rows use the simple schema with `answer` holding the complete
target response. The loss is the actor's own positive-example NLL (component 6) with every
response marked correct and zero advantages: L = -(1/N) sum log p(target tokens), through the
same schedule and normalization as the RL updates, with an optimizer of its own (Adam moments of
supervised gradients would otherwise damp the first hundreds of RL steps; beta2 = 0.999 remembers
~1000 steps). When SFT ends, the RL optimizer takes the weights over (reload_model_params) and the
critic starts from the warm-started policy's trunk (VAPO.md component 1).
"""

from __future__ import annotations

from typing import Iterator

import torch

import dataclasses

from vapo_megatron.actor import PolicyLossSettings
from vapo_megatron.batch import RolloutBatch, pack_sequences
from vapo_megatron.data.prompts import PromptSampler
from vapo_megatron.rollout_collect import evaluate
from vapo_megatron.megatron_step import build_optimizer
from vapo_megatron.run_state import param_dtype, sync_weights
from vapo_megatron.updates import TrainModel, update_actor


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


def sft_steps(cfg, actor: TrainModel, ctx, *, start: int) -> Iterator[tuple[int, dict, bool]]:
    """Yields (step, logs, finished). Stops early once greedy accuracy on RL-train prompts
    reaches sft.target_accuracy: a tiny model's SFT generalizes in a sharp, seed-dependent
    transition, so a step count alone over- or under-shoots (docs/data_and_rewards.md)."""
    s, d = cfg.sft, cfg.data
    sampler = PromptSampler(ctx.sft_records, s.batch_size, d.seed + 1)
    for _ in range(start):  # deterministic position on resume
        sampler.next_batch()
    sft_optim = dataclasses.replace(cfg.actor_optim, lr=s.lr, warmup_steps=0)
    model = dataclasses.replace(actor, optimizer=build_optimizer(actor.chunks, sft_optim, params_dtype=param_dtype(cfg)))
    settings = PolicyLossSettings(eps_low=0.2, eps_high=0.2, dual_clip_c=None, loss_agg="token",
                                  nll_coef=1.0, temperature=1.0, chunk_tokens=cfg.trainer.logprob_chunk_tokens)
    for step in range(start, s.steps):
        batch = _sft_batch(ctx.dp_share(sampler.next_batch()), ctx.tokenizer, ctx.stop_token_ids[0])
        logs = update_actor(model, batch, settings, mini_batches=1, epochs=1,
                            max_tokens=cfg.trainer.micro_batch_tokens, lr=s.lr,
                            max_consecutive_skips=cfg.trainer.max_consecutive_skips)
        out = {"sft/nll_loss": logs["actor/nll_loss"], "sft/grad_norm": logs["actor/grad_norm"], "sft/step": step + 1}
        done = step + 1 == s.steps
        if s.target_accuracy is not None and (step + 1) % s.eval_every == 0:
            sync_weights(actor, ctx.engine, version=-1, cfg=cfg)
            out["sft/train_accuracy"] = evaluate(ctx, ctx.train_records[: s.eval_prompts])
            done = done or out["sft/train_accuracy"] >= s.target_accuracy
        yield step, out, done
        if done:
            return
