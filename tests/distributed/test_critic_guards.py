"""Issue 32: critic bugs peers shipped, each guarded here (docs/algorithm.md, "Critic bugs peers
shipped, and the tests that guard them", says which mutation of the source each check fails on).

- The value mask off by one under dynamic batching: the critic's values (mcore/update.py
  forward_only, micro-batches packed by token budget and trimmed to their own width) sit exactly at
  the prediction positions [prompt_len - 1, prompt_len - 1 + response_len), and do not depend on
  how the rows were packed: each row's values equal those of the whole batch in one micro-batch
  and of the row alone.
- The value head's optimizer ignoring the LR schedule: every optimizer param group that holds a
  value-head parameter has the scheduled rate at every update (the metric critic/lr reads one
  canonical group only), and a warm-up update at rate 0 leaves the head unchanged.
- Critic gradients not reduced over DP, and a value loss averaged per micro-batch: the trainer's
  own critic update (Critic.update: mini-batch, global counts, token-budget micro-batches, DDP,
  optimizer step) at DP=2 with uneven shares and micro-batches of different widths leaves every
  replica's parameters where one naive step on the whole batch puts them (one plain forward, the
  clipped value loss written out over the global N, autograd, SGD by hand).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.helpers.dist_utils import run_ranks

PROMPTS = [3, 5, 4, 6, 2, 7]
RESPONSES = [9, 1, 6, 2, 11, 3]


def _batch():
    from vapo_megatron.data.batch import RolloutBatch, pack_sequences

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 250, (n,), generator=g).tolist() for n in PROMPTS]
    responses = [torch.randint(1, 250, (n,), generator=g).tolist() for n in RESPONSES]
    tokens, pl, rl = pack_sequences(prompts, responses)
    B = len(PROMPTS)
    return RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=torch.ones(B),
                        correct=torch.ones(B, dtype=torch.bool), group_ids=torch.arange(B) // 2)


def _checks():
    from model_providers.presets import preset
    from vapo_megatron.config import OptimConfig
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.critic import value_outputs
    from vapo_megatron.mcore.model import wrap_ddp
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.mcore.optimizer import build_lr_scheduler, build_optimizer, current_lr
    from vapo_megatron.mcore.update import forward_only, micro_batches

    parallel.init_distributed(1, 1, seed=3)
    chunks = wrap_ddp(build_chunks(preset("tiny-qwen2"), params_dtype=torch.float32, critic=True, on_gpu=False),
                      distributed_optimizer=False)
    model = SimpleNamespace(chunks=chunks, replay=None)  # a TrainModel's fields forward_only reads
    batch = _batch()
    out = {}
    # ---- values under dynamic batching
    budget = 24
    plan, micro = micro_batches(batch, budget)
    out["widths"] = [m.tokens.shape[1] for m in micro]
    packed = forward_only(model, batch, value_outputs, ("values",), budget)["values"]
    whole = forward_only(model, batch, value_outputs, ("values",), 10**6)["values"]
    alone = []
    for i in range(batch.size):
        row = batch.select([i])
        alone.append(forward_only(model, row, value_outputs, ("values",), 10**6)["values"][0])
    with torch.no_grad():  # an independent reference: one plain forward of the model, no schedule, no packing
        direct = chunks[0].module(batch.tokens, torch.arange(batch.tokens.shape[1])[None].expand_as(batch.tokens), None)
    out["values"] = (packed, whole, alone, batch.mask.clone(), direct.float() * batch.mask)
    # ---- the value head's learning rate
    optim = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, lr_decay_style="cosine", lr_decay_steps=6, clip_grad=0.0)
    opt = build_optimizer(chunks, optim, params_dtype=torch.float32, kind="sgd")
    sched = build_lr_scheduler(opt, optim, planned_updates=10)
    head = chunks[0].module.value_head
    head_ids = {id(head.weight), id(head.bias)}
    rates = []
    for _ in range(8):
        groups = [g for g in opt.param_groups if head_ids & {id(p) for p in g["params"]}]
        covered = set().union(*({id(p) for p in g["params"]} for g in groups)) & head_ids
        rates.append((current_lr(opt), [g["lr"] for g in groups], covered == head_ids))
        sched.step(1)
    out["rates"] = rates
    # ---- an update at warm-up's rate 0 leaves the head where it was (its gradient is not zero)
    from vapo_megatron.mcore.optimizer import set_lr_steps

    set_lr_steps(sched, 0)
    before = {k: v.detach().clone() for k, v in head.state_dict().items()}
    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    values = chunks[0](batch.tokens, torch.arange(batch.tokens.shape[1])[None].expand_as(batch.tokens), None)
    (values * batch.mask).sum().backward()
    grads = [p.main_grad.abs().sum().item() for p in (head.weight, head.bias)]
    opt.step()
    out["head_step"] = (grads, all(torch.equal(before[k], v) for k, v in head.state_dict().items()))
    return out


def _scheduled(s: int) -> float:
    lr, min_lr, warmup, decay = 1e-2, 1e-3, 2, 6
    if s <= warmup:
        return lr * s / warmup
    if s > decay:
        return min_lr
    r = (s - warmup) / (decay - warmup)
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * r)) / 2


def test_critic_guards():
    (res,) = run_ranks(1, _checks)
    # Dynamic batching: several micro-batches of different widths.
    assert len(res["widths"]) > 1 and len(set(res["widths"])) > 1, res["widths"]
    packed, whole, alone, mask, direct = res["values"]
    # V_t is the model's output at the position that predicts response token t (the state before
    # it): a shift applied the same way to every packing keeps the support and the agreement below.
    torch.testing.assert_close(packed, direct, rtol=0, atol=1e-5)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        support = torch.nonzero(packed[i]).flatten().tolist()
        assert support == list(range(p - 1, p - 1 + r)), (i, support)  # the prediction positions, no more, no less
        assert torch.equal(mask[i].nonzero().flatten(), torch.tensor(support))
        torch.testing.assert_close(packed[i], whole[i], rtol=0, atol=1e-5)
        torch.testing.assert_close(packed[i, : alone[i].shape[0]], alone[i], rtol=0, atol=1e-5)
    # The value head's param groups follow the schedule at every update.
    for s, (canonical, head_rates, covered) in enumerate(res["rates"]):
        assert covered, "a value-head parameter is in no optimizer param group"
        assert head_rates and all(abs(r - _scheduled(s)) < 1e-12 for r in head_rates), (s, head_rates)
        assert abs(canonical - _scheduled(s)) < 1e-12
    grads, unchanged = res["head_step"]
    assert all(g > 0 for g in grads) and unchanged  # warm-up's first rate is 0: the head does not move


# ---- the critic update as the trainer runs it, at DP=2, against one naive step ----------------------------

LR, CLIP, BUDGET = 0.5, 0.2, 16
SHARES = ([0, 1], [2, 3, 4, 5])  # whole prompt groups per DP rank, as the trainer deals them: 18 and 41 tokens


def _update_vs_naive(k: int = 1):
    from model_providers import family_for
    from model_providers.presets import preset
    from vapo_megatron.config import OptimConfig
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.critic import Critic
    from vapo_megatron.mcore.model import TrainModel, wrap_ddp
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.mcore.optimizer import build_optimizer
    from vapo_megatron.mcore.update import UpdateSettings, micro_batches

    parallel.init_distributed(1, 1, seed=3)
    assert parallel.dp_size() == 2
    hf = preset("tiny-qwen2")
    chunks = wrap_ddp(build_chunks(hf, params_dtype=torch.float32, critic=True, on_gpu=False),
                      distributed_optimizer=False)
    module = chunks[0].module
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    batch = _batch()
    mask, S = batch.mask, batch.tokens.shape[1]
    g = torch.Generator().manual_seed(11)
    returns = torch.randn(batch.size, S, generator=g) * mask
    noise = 0.3 * torch.randn(batch.size, S, generator=g) * mask

    # The reference: the whole global batch on this rank, written out; no schedule, DDP or optimizer.
    # K passes (critic.updates_per_step): K plain SGD steps, each on the values of the weights the
    # last one left, against the same old values and returns.
    params = dict(module.named_parameters())
    positions = torch.arange(S)[None].expand_as(batch.tokens)
    old = module(batch.tokens, positions, None).float().detach() + noise
    weights = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    for step in range(k):
        values = torch.func.functional_call(module, weights, (batch.tokens, positions, None)).float()
        clipped = old + (values - old).clamp(-CLIP, CLIP)
        per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
        step_loss = (per_token * mask).sum() / mask.sum()
        if step == 0:
            loss = step_loss  # the first pass's: a step's log is the mean over its passes
        grads = torch.autograd.grad(step_loss, list(weights.values()))
        weights = {n: (w - LR * gr).detach().requires_grad_() for (n, w), gr in zip(weights.items(), grads)}
    want = {n: w.detach() for n, w in weights.items()}

    # The trainer's update on this rank's share.
    batch.values, batch.returns = old * mask, returns
    mine = batch.select(SHARES[parallel.dp_rank()])
    model = TrainModel(chunks=chunks, optimizer=build_optimizer(chunks, OptimConfig(lr=LR, clip_grad=0.0),
                                                                params_dtype=torch.float32, kind="sgd"),
                       scheduler=None, family=family_for(hf), hf_cfg=hf, hf_dir=Path("."), critic=True, dtype="float32")
    critic = Critic(model, clip_range=CLIP, update=UpdateSettings(mini_batches=1, epochs=1, max_tokens=BUDGET,
                                                                  max_consecutive_skips=1), passes=k)
    logs = critic.update(mine, value_pretrain=False)
    have = {n: p.detach().clone() for n, p in module.named_parameters()}
    widths = [m.tokens.shape[1] for m in micro_batches(mine, BUDGET)[1]]
    return {"initial": initial, "want": want, "have": have, "loss": loss.item(), "logs": logs, "widths": widths}


def test_the_critic_update_at_dp2_equals_one_naive_step():
    ranks = run_ranks(2, _update_vs_naive)
    widths = [w for r in ranks for w in r["widths"]]
    assert len(widths) >= 4 and len(set(widths)) >= 3, widths  # several micro-batches of different widths
    for rank, res in enumerate(ranks):
        logs = res["logs"]
        assert logs["critic/skipped_steps"] == 0.0
        assert 0.0 < logs["critic/value_clipfrac"] < 1.0, logs  # both branches of the clipped loss
        assert abs(logs["critic/value_loss"] - res["loss"]) <= 1e-5 * abs(res["loss"]), (rank, logs, res["loss"])
        _same_weights(rank, res)


def _same_weights(rank, res):
    for name, want in res["want"].items():
        have = res["have"][name]
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
        d_have, d_want = have - res["initial"][name], want - res["initial"][name]
        assert d_want.norm() > 0, name
        err = (d_have - d_want).norm() / d_want.norm()
        assert err < 1e-3, f"rank {rank} {name}: the update differs by {err:.2e} relative"


def test_k_critic_passes_at_dp2_equal_k_naive_steps():
    """critic.updates_per_step=2: the update runs twice over the step's rollouts, on two DP ranks
    with uneven shares and several micro-batches each, and equals two plain steps in sequence."""
    ranks = run_ranks(2, _update_vs_naive, 2)
    for rank, res in enumerate(ranks):
        assert res["logs"]["critic/updates_per_step"] == 2.0 and res["logs"]["critic/skipped_steps"] == 0.0
        _same_weights(rank, res)
