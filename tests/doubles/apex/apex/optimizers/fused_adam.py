"""Test double of apex.optimizers.FusedAdam (apex/optimizers/fused_adam.py), pure torch.

What megatron-core and this project depend on, as Apex has it:
- the step count lives in the param GROUP (`group["step"]`, an int: 1 at the first step, then
  incremented; "assume same step across group now"); per-parameter state holds only `exp_avg`
  and `exp_avg_sq`, float32;
- state is created at a step only for parameters that have a gradient (unlike TE's FusedAdam);
- no state_dict/load_state_dict of its own (torch's);
- AMSGrad and the deprecated step arguments are refused; capturable mode and use_master are not
  modelled and refused.
"""

from __future__ import annotations

import torch

from tests.doubles.fused_adam_math import adam_update


class FusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, use_master=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if capturable or use_master:
            raise NotImplementedError("test double: capturable / use_master not modelled")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.capturable = capturable

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, grad_scaler=None):
        if any(x is not None for x in (grads, output_params, scale, grad_norms)):
            raise RuntimeError("FusedAdam has been updated.  Simply initialize it identically to torch.optim.Adam, "
                               "and call step() with no arguments.")
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            group["step"] = group["step"] + 1 if "step" in group else 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                adam_update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"], beta1=beta1, beta2=beta2,
                            eps=group["eps"], step=group["step"], adam_w_mode=self.adam_w_mode,
                            bias_correction=group["bias_correction"], weight_decay=group["weight_decay"])
        return loss
