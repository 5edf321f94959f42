"""The critic on Megatron: values V_t (forward only) and the clipped value-loss update.

Value loss of the global mini-batch (token-level, like the policy loss, VAPO sec. 3):
    L_V = (1/N) sum_i sum_t 0.5 * max((V - G)^2, (clip(V, V_old - c, V_old + c) - G)^2)
Each micro-batch returns (value_loss_sum, its response tokens); finalize_model_grads divides
by their global total N (megatron_step.py), so the gradient is exactly grad L_V. Returns G_t
come from GAE with lambda_critic (1.0: Monte-Carlo returns, component 2).
"""

from __future__ import annotations

from functools import partial

import torch

from vapo_megatron import parallel
from vapo_megatron.actor import _forward_step
from vapo_megatron.algorithms.losses import value_loss_sum
from vapo_megatron.batch import RolloutBatch
from vapo_megatron.megatron_step import forward_backward


def _values_out(mb: RolloutBatch, values: torch.Tensor):
    # values: [b, S] float32, V at every position (the caller masks to prediction positions)
    zero = values.new_zeros(())
    return zero, torch.tensor(1, dtype=torch.int), {"values": (values.detach().float() * mb.mask.to(values.device)).cpu()}


@torch.no_grad()
def compute_values(model_chunks: list, micro_batches: list[RolloutBatch]) -> list[dict] | None:
    """Per micro-batch {"values": [b, S]} on the last stage (None elsewhere)."""
    for chunk in model_chunks:
        chunk.eval()
    outputs = forward_backward(model_chunks, partial(_forward_step, _values_out), micro_batches, forward_only=True)
    return outputs if parallel.is_last_stage() else None


def _value_loss(mb: RolloutBatch, values: torch.Tensor, *, clip_range: float | None):
    device = values.device
    mask = mb.mask.to(device)
    loss_sum, metrics = value_loss_sum(
        values.float(), mb.values.to(device), mb.returns.to(device), mask, clip_range=clip_range,
    )
    logs = {f"critic/{k}_sum": v.detach() for k, v in metrics.items()}
    logs["critic/value_loss_sum"] = loss_sum.detach()  # / N -> L_V
    return loss_sum, mask.sum().int().cpu(), logs


def train_mini_batch(model_chunks: list, micro_batches: list[RolloutBatch], *, clip_range: float | None) -> list[dict]:
    """Forward + backward of one global mini-batch; grads normalized by N. Caller steps."""
    for chunk in model_chunks:
        chunk.train()
    return forward_backward(
        model_chunks, partial(_forward_step, partial(_value_loss, clip_range=clip_range)),
        micro_batches, forward_only=False,
    )
