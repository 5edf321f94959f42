"""Test double of apex.optimizers.FusedAdam (NVIDIA/apex 6424da3, apex/optimizers/fused_adam.py),
pure torch.

What megatron-core and this project depend on, as Apex has it:
- __init__(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
  set_grad_none, capturable, master_weights) (lines 68-81); AMSGrad refused (82-83); master
  weights only with capturable (84-87: RuntimeError otherwise); a master copy per parameter in
  `param_groups_master` (105-115: None without master weights);
- zero_grad() takes no argument (138-144): with set_grad_none (default True) every grad is set to
  None, else torch's zero_grad with its own default;
- step (146-): the deprecated arguments refused (163-166); an EMPTY group is skipped BEFORE its
  step count (172-173), so it never gets one; else the count (`group["step"]`, an int, 1 at the
  first step) advances (180-187) for the group, with or without gradients; then per parameter, a
  parameter without a gradient is skipped (197-198) BEFORE its state is created (204-210: state
  only for parameters that have a gradient, unlike TE's FusedAdam); state holds `exp_avg` and
  `exp_avg_sq`, float32; fp16, bf16 and fp32 parameters only (212-232);
- no state_dict/load_state_dict of its own (torch's);
- the kernel's arithmetic: tests/doubles/fused_adam_math.py.
Capturable mode (and so master weights) is not modelled and refused (NotImplementedError).
"""

from __future__ import annotations

import torch

from tests.doubles.fused_adam_math import adam_update


class FusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, master_weights=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if master_weights and not capturable:
            raise RuntimeError("Master weights is currently only supported with the capturable version.")
        if capturable:
            raise NotImplementedError("test double: capturable (and master_weights) not modelled")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self.master_weights = master_weights
        self.param_groups_master = [{"params": [None for _ in pg["params"]]} for pg in self.param_groups]

    def zero_grad(self):
        if self.set_grad_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            super().zero_grad()

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, grad_scaler=None):
        if any(x is not None for x in (grads, output_params, scale, grad_norms)):
            raise RuntimeError("FusedAdam has been updated.  Simply initialize it identically to torch.optim.Adam, "
                               "and call step() with no arguments.")
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if len(group["params"]) == 0:  # lines 172-173: before the count
                continue
            group["step"] = group["step"] + 1 if "step" in group else 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p.data).float()
                    state["exp_avg_sq"] = torch.zeros_like(p.data).float()
                if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                    raise RuntimeError("FusedAdam only support fp16 and fp32.")
                adam_update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"], beta1=beta1, beta2=beta2,
                            eps=group["eps"], step=group["step"], adam_w_mode=self.adam_w_mode,
                            bias_correction=group["bias_correction"], weight_decay=group["weight_decay"])
        return loss
