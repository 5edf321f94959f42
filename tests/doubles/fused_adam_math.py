"""The arithmetic of TE's and Apex's multi_tensor_adam kernel, in plain torch (test double).

Both libraries' FusedAdam hand their kernel (TE: transformer_engine/common/multi_tensor/adam.cu,
lines 125-142 at d0067d0; Apex: csrc/multi_tensor_adam.cu, lines 78-95 at 6424da3) one step count
per parameter GROUP, and compute in float32:

    mode 0 (L2):     g += wd * p
    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
    update = (m / bc1) / (sqrt(v / bc2) + eps)          bc = 1 - b^step (1 without bias correction)
    mode 1 (AdamW):  update += wd * p
    p -= lr * update
"""

from __future__ import annotations

import torch


@torch.no_grad()
def adam_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, beta1: float,
                beta2: float, eps: float, step: int, adam_w_mode: int, bias_correction: bool,
                weight_decay: float) -> None:
    """One kernel step on one tensor, in place (p in its own dtype; m, v float32)."""
    p32, g32 = p.float(), g.float()
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    if adam_w_mode == 0:
        g32 = g32 + weight_decay * p32
    m.mul_(beta1).add_(g32, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    if adam_w_mode == 1:
        update = update + weight_decay * p32
    p.copy_((p32 - lr * update).to(p.dtype))
