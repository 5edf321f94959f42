"""Issue 32, item 8: two critic bugs other trainers shipped, where no test guarded them here
(docs/algorithm.md, "Critic bugs other trainers shipped, and the test that guards each").

- The value mask off by one under dynamic batching: the critic's values (mcore/update.py
  forward_only, micro-batches packed by token budget and trimmed to their own width) sit exactly at
  the prediction positions [prompt_len - 1, prompt_len - 1 + response_len), and do not depend on
  how the rows were packed: each row's values equal those of the whole batch in one micro-batch
  and of the row alone.
- The value head's optimizer ignoring the LR schedule: every optimizer param group that holds a
  value-head parameter has the scheduled rate at every update (the metric critic/lr reads one
  canonical group only), and a warm-up update at rate 0 leaves the head unchanged.
"""

from __future__ import annotations

import math
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
    model = SimpleNamespace(chunks=chunks)
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
    out["values"] = (packed, whole, alone, batch.mask.clone())
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
    packed, whole, alone, mask = res["values"]
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
