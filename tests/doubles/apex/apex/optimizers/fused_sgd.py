"""Test double of apex.optimizers.FusedSGD (apex/optimizers/fused_sgd.py, NVIDIA/apex 6424da3),
pure torch: megatron-core imports it as its SGD when TE does not import and Apex does
(optimizer/__init__.py).

As Apex has it:
- the constructor's checks (lines 89-104: negative lr, momentum or weight decay; Nesterov without
  momentum or with dampening) and its need of the amp_C extension (lines 113-122);
- a step hands each group's float16 and float32 parameters that have a gradient to
  amp_C.multi_tensor_sgd, one launch per dtype (lines 238-279); parameters of any other dtype
  (bfloat16) are left as they are, without an error;
- the momentum buffer is created at a parameter's first step (zeros, the parameter's dtype), and
  that launch tells the kernel it is the first run, so the momentum starts as the gradient
  (get_momentums, lines 137-152; the kernel: tests/doubles/apex/amp_C.py);
- `most_recent_scale` (1.0 unless amp set it) divides the gradients, and is reset after the step;
- zero_grad() takes no argument and sets grads to None only with set_grad_none (lines 129-135).
Not modelled, refused: amp's master-parameter stash (`_amp_stash`, lines 165-236).
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import Optimizer, required

from apex.multi_tensor_apply import multi_tensor_applier


class FusedSGD(Optimizer):
    def __init__(self, params, lr=required, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False):
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov))
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        self.set_grad_none = set_grad_none
        if not multi_tensor_applier.available:
            raise RuntimeError("apex.optimizers.FusedSGD requires cuda extensions")
        import amp_C

        self._dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device=self.param_groups[0]["params"][0].device)
        self.multi_tensor_sgd = amp_C.multi_tensor_sgd

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def zero_grad(self):
        if not self.set_grad_none:
            return super().zero_grad(set_to_none=False)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def _momenta(self, params) -> tuple[list, bool]:
        """Each parameter's momentum buffer, created at its first step; whether this launch is a
        first run (as Apex decides it: from the last parameter of the launch)."""
        out, first = [], True
        for p in params:
            state = self.state[p]
            first = "momentum_buffer" not in state
            if first:
                state["momentum_buffer"] = torch.zeros_like(p.data)
            out.append(state["momentum_buffer"])
        return out, first

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if hasattr(self, "_amp_stash") and hasattr(self._amp_stash, "fp32_from_fp16_groups"):
            raise NotImplementedError("test double: amp's master-parameter stash is not modelled")
        for group in self.param_groups:
            for dtype in (torch.float16, torch.float32):
                params = [p for p in group["params"] if p.dtype == dtype and p.grad is not None]
                if not params:
                    continue
                momenta, first_run = self._momenta(params)
                multi_tensor_applier(self.multi_tensor_sgd, self._dummy_overflow_buf, [[p.grad for p in params], params,
                                     momenta], group["weight_decay"], group["momentum"], group["dampening"],
                                     group["lr"], group["nesterov"], first_run, self.wd_after_momentum,
                                     1.0 / self.most_recent_scale)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss
