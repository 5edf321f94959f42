"""Checks of the Apex world's FusedAdam double (tests/doubles/apex/apex/optimizers/fused_adam.py)
against what NVIDIA/apex 6424da3 apex/optimizers/fused_adam.py does, one behaviour each; run in the
Apex world with tests/unit/test_apex_doubles.py's checks (its CHECKS holds these too)."""

from __future__ import annotations

import inspect

import torch


def _param(n: int, seed: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(seed)))


def fused_adam_steps_as_torch_adamw_with_state_only_for_gradients():
    """step, lines 196-210: a parameter without a gradient is skipped before its state is made (no
    state, unlike TE's FusedAdam), while its group's count advances (180-187); the update of the
    others is torch.optim.AdamW's (the kernel's arithmetic, csrc/multi_tensor_adam.cu 88-95)."""
    from apex.optimizers import FusedAdam

    p, q, idle = _param(5, 1), _param(5, 1), _param(2, 2)
    ours = FusedAdam([p, idle], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    ref = torch.optim.AdamW([q], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(2):
        p.grad = torch.randn(5, generator=torch.Generator().manual_seed(10 + step))
        q.grad = p.grad.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert ours.param_groups[0]["step"] == 2 and set(ours.state[p]) == {"exp_avg", "exp_avg_sq"}
    assert ours.state[p]["exp_avg"].dtype == torch.float32 and idle not in ours.state


def fused_adam_skips_an_empty_group_before_counting():
    """step, lines 171-187: an empty group is skipped before its step count, so it never has one;
    the populated group counts every step (TE's FusedAdam counts both: te_kernel_checks.py)."""
    from apex.optimizers import FusedAdam

    p = _param(3, 3)
    opt = FusedAdam([{"params": [p]}, {"params": []}], lr=0.01)
    for step in range(3):
        p.grad = torch.ones(3)
        opt.step()
    assert opt.param_groups[0]["step"] == 3 and "step" not in opt.param_groups[1]


def fused_adam_takes_apexs_arguments():
    """__init__, lines 68-87: Apex's parameters in Apex's order, `master_weights` (not TE's keyword-
    only set), refused without capturable; param_groups_master holds None per parameter without
    master weights (105-115)."""
    from apex.optimizers import FusedAdam

    names = list(inspect.signature(FusedAdam.__init__).parameters)[1:]
    assert names == ["params", "lr", "bias_correction", "betas", "eps", "adam_w_mode", "weight_decay", "amsgrad",
                     "set_grad_none", "capturable", "master_weights"], names
    p = _param(3, 4)
    try:
        FusedAdam([p], master_weights=True)
        raise AssertionError("master_weights without capturable did not raise")
    except RuntimeError as e:
        assert "Master weights is currently only supported with the capturable version." in str(e)
    assert FusedAdam([p]).param_groups_master == [{"params": [None]}]


def fused_adam_zero_grad_takes_no_argument():
    """zero_grad, lines 138-144: no set_to_none argument; set_grad_none (default True) sets every
    grad to None, False defers to torch's zero_grad (whose own default, set_to_none=True, also
    drops them)."""
    from apex.optimizers import FusedAdam

    assert list(inspect.signature(FusedAdam.zero_grad).parameters) == ["self"]
    p = _param(3, 5)
    for set_grad_none in (True, False):
        p.grad = torch.ones(3)
        FusedAdam([p], set_grad_none=set_grad_none).zero_grad()
        assert p.grad is None
    try:
        FusedAdam([p]).zero_grad(set_to_none=False)
        raise AssertionError("zero_grad took an argument")
    except TypeError:
        pass


CHECKS = {fn.__name__: fn for fn in (fused_adam_steps_as_torch_adamw_with_state_only_for_gradients,
                                     fused_adam_skips_an_empty_group_before_counting, fused_adam_takes_apexs_arguments,
                                     fused_adam_zero_grad_takes_no_argument)}
