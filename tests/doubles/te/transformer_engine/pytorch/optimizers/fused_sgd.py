"""Test double of transformer_engine/pytorch/optimizers/fused_sgd.py `FusedSGD` (megatron's SGD when
TE imports; this project's optimizer is Adam), pure torch.

As TE has it (fused_sgd.py `step`, kernel common/multi_tensor/sgd.cu): per group, the float16 and
the float32 parameters that have a gradient form two launches (other dtypes are left alone);
per-parameter state `momentum_buffer` (zeros when created); `first_run` of a launch is whether
its LAST parameter's buffer was just created. In float32, per element:
    g = grad * scale (1);   g += wd * p unless wd_after_momentum
    momentum != 0:  m = g on a first run, else momentum * m + (1 - dampening) * g;
                    g = g + momentum * m (nesterov) or m
    g += wd * p if wd_after_momentum;   p -= lr * g
zero_grad sets gradients to None by default. AMP master-parameter stashes are not modelled.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import Optimizer, required


class FusedSGD(Optimizer):
    def __init__(self, params, lr=required, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, *, wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none=None):
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": nesterov})
        self.wd_after_momentum = wd_after_momentum
        self.most_recent_scale = 1.0
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none=None) -> None:
        if self.set_grad_none is not None:
            set_to_none = self.set_grad_none
        super().zero_grad(set_to_none=True if set_to_none is None else set_to_none)

    def _momentums(self, params):
        momentums, first_run = [], True
        for p in params:
            state = self.state[p]
            first_run = "momentum_buffer" not in state
            if first_run:
                state["momentum_buffer"] = torch.zeros_like(p.data)
            momentums.append(state["momentum_buffer"])
        return momentums, first_run

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            wd, momentum, dampening = group["weight_decay"], group["momentum"], group["dampening"]
            for dtype in (torch.float16, torch.float32):
                params = [p for p in group["params"] if p.dtype == dtype and p.grad is not None]
                if not params:
                    continue
                momentums, first_run = self._momentums(params)
                for p, m in zip(params, momentums):
                    g, w, m32 = p.grad.float() * self.most_recent_scale, p.float(), m.float()
                    if wd != 0 and not self.wd_after_momentum:
                        g = g + wd * w
                    if momentum != 0:
                        m32 = g.clone() if first_run else m32 * momentum + (1 - dampening) * g
                        g = g + momentum * m32 if group["nesterov"] else m32
                        m.copy_(m32.to(m.dtype))
                    if wd != 0 and self.wd_after_momentum:
                        g = g + wd * w
                    p.copy_((w - group["lr"] * g).to(p.dtype))
        return loss


__all__ = ["FusedSGD"]
