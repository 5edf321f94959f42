"""Test double of transformer_engine.pytorch.optimizers.FusedAdam, pure torch. Source: NVIDIA/
TransformerEngine transformer_engine/pytorch/optimizers/fused_adam.py, the same file in release_v2.19
and main (2.20.0.dev0, d0067d0); line numbers are main's.

What megatron-core and this project depend on, as TE has it:
- __init__ (lines 112-230): AMSGrad refused; the state dtypes checked; `set_grad_none` deprecated
  (a DeprecationWarning, then zero_grad must agree with it);
- zero_grad (231-262): set_to_none defaults to True (or to set_grad_none); True sets every grad to
  None, False is torch's zero_grad;
- step (546-): for EVERY group, the step count (`group["step"]`, an int, 1 at the first step) is
  advanced first, and only then an empty group skipped (560-586, TE PR #3318: "a param group can be
  empty on some data-parallel ranks and populated on others"; counting only populated groups
  desynchronized the step across the ranks that share an optimizer state shard); then per
  parameter, state created when empty (629-630) BEFORE the check for a missing gradient (637-638),
  so every parameter of a stepped group has state; per-parameter state holds only `exp_avg` and
  `exp_avg_sq` (initialize_state, 452-460), float32 by default;
- state_dict (478-509) returns the moments unscaled in float32; load_state_dict (511-544) sets
  them again after torch's load, which casts them to the parameter's dtype (a plain float32 copy
  with float32 moments);
- the kernel's arithmetic: tests/doubles/fused_adam_math.py.
Capturable mode, master weights, decoupled gradients, FP8 and non-float32 state dtypes are not
modelled and refused (NotImplementedError), so a path that would need them fails loudly instead
of passing untested.
"""

from __future__ import annotations

import warnings

import torch

from tests.doubles.fused_adam_math import adam_update


class FusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False, set_grad_none=None):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        unsupported = {"capturable": capturable, "master_weights": master_weights,
                       "use_decoupled_grad": use_decoupled_grad,
                       "non-float32 state": (exp_avg_dtype, exp_avg_sq_dtype, master_weight_dtype) != (torch.float32,) * 3}
        if any(unsupported.values()):
            raise NotImplementedError(f"test double: {[k for k, v in unsupported.items() if v]} not modelled")
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = store_param_remainders and master_weights
        self.set_grad_none = set_grad_none  # lines 222-229
        if self.set_grad_none is not None:
            warnings.warn("set_grad_none kwarg in FusedAdam constructor is deprecated. "
                          "Use set_to_none kwarg in zero_grad instead.", DeprecationWarning)

    def initialize_state(self, param, store_param_remainders=False):
        self.state[param]["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        self.state[param]["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)

    def zero_grad(self, set_to_none=None):
        if self.set_grad_none is not None:
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(f"Called zero_grad with set_to_none={set_to_none}, "
                                 f"but FusedAdam was initialized with set_grad_none={self.set_grad_none}")
            set_to_none = self.set_grad_none
        if set_to_none is None:
            set_to_none = True
        if not set_to_none:  # use_decoupled_grad is refused above
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_dict(self):
        sd = super().state_dict()
        for v in sd["state"].values():  # float32 already: TE's unscaling is the identity here
            for name in v:
                v[name] = v[name].float()
        return sd

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        # torch's load casts state to the parameter's dtype; TE sets float32 moments again.
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i in state_dict["state"]:
                self.state[p] = {k: v.float().clone() for k, v in state_dict["state"][i].items() if v is not None}

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            # Lines 560-586: the count first, for every group, then an empty group is skipped.
            group["step"] = group["step"] + 1 if "step" in group else 1
            if len(group["params"]) == 0:
                continue
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    self.initialize_state(p)
                if p.grad is None:
                    continue
                adam_update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"], beta1=beta1, beta2=beta2,
                            eps=group["eps"], step=group["step"], adam_w_mode=self.adam_w_mode,
                            bias_correction=group["bias_correction"], weight_decay=group["weight_decay"])
        return loss
