"""The learning-rate schedule of OptimConfig (mcore/optimizer.py, megatron-core's
OptimizerParamScheduler) against the schedule computed by hand from its definition:
update s (0-based) uses lr * s / W while s <= W (W = warmup_steps), then lr ("constant"), or
min_lr + (lr - min_lr) * c(r) with r = (s - W) / (D - W) (D = lr_decay_steps), c = 1 - r
("linear") or (1 + cos(pi r)) / 2 ("cosine"), and min_lr after update D."""

from __future__ import annotations

import math

import pytest
import torch

from vapo_megatron.config import OptimConfig
from vapo_megatron.mcore.optimizer import build_lr_scheduler, current_lr, set_lr_steps

LR, MIN_LR = 1e-3, 1e-4


def _by_hand(s: int, style: str, warmup: int, decay: int) -> float:
    if warmup > 0 and s <= warmup:
        return LR * s / warmup
    if style == "constant":
        return LR
    if s > decay:
        return MIN_LR
    r = (s - warmup) / (decay - warmup)
    c = 1 - r if style == "linear" else (1 + math.cos(math.pi * r)) / 2
    return MIN_LR + (LR - MIN_LR) * c


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=LR)


@pytest.mark.parametrize("style,warmup,decay_steps,planned", [
    ("constant", 0, None, 20), ("constant", 4, None, 20), ("linear", 4, None, 12), ("linear", 3, 8, 100),
    ("cosine", 2, None, 10), ("cosine", 0, 6, 100),
])
def test_schedule_matches_the_hand_computed_one(style, warmup, decay_steps, planned):
    optim = OptimConfig(lr=LR, min_lr=MIN_LR, warmup_steps=warmup, lr_decay_style=style, lr_decay_steps=decay_steps)
    opt = _optimizer()
    sched = build_lr_scheduler(opt, optim, planned_updates=planned)
    decay = decay_steps if decay_steps is not None else planned
    for s in range(planned + 5):
        assert current_lr(opt) == pytest.approx(_by_hand(s, style, warmup, decay), rel=1e-12, abs=1e-15), s
        sched.step(1)  # what an applied optimizer step does


def test_a_resumed_schedule_continues_exactly():
    optim = OptimConfig(lr=LR, min_lr=MIN_LR, warmup_steps=3, lr_decay_style="cosine")
    a, b = _optimizer(), _optimizer()
    run = build_lr_scheduler(a, optim, planned_updates=10)
    for _ in range(7):
        run.step(1)
    resumed = build_lr_scheduler(b, optim, planned_updates=10)
    set_lr_steps(resumed, run.num_steps)  # what a resume does with RunState's saved count
    for _ in range(5):
        assert current_lr(b) == current_lr(a)
        run.step(1)
        resumed.step(1)
