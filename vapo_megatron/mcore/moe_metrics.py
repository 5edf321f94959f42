"""The router's load-balancing loss of a mixture-of-experts model, read back for the logs.

megatron-core adds the loss (model.moe_aux_loss_coeff times its sequence-level aux_loss) to the
gradients itself, inside each router's forward (MoEAuxLossAutoScaler), and records the unweighted
value per layer in its metrics tracker (transformer/moe/moe_logging.py). Under per-token loss
(schedule.py) megatron weights it so that its gradient is coeff * mean over micro-batches and
DP ranks, whatever the token normalization of the main loss (router.py,
attach_and_log_load_balancing_loss). This module only reads the recorded values: the mean over
MoE layers, micro-batches and data-parallel ranks, reduced as megatron's own report does (summed
over the record's group, i.e. the TP ranks that each routed part of the sequence, and over the
pipeline stages, which hold disjoint layers; averaged over DP).
"""

from __future__ import annotations

import torch

from vapo_megatron.mcore import parallel

TRACKED = "load_balancing_loss"  # megatron's name for the aux_loss record (router.py)


def _tracker():
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return get_moe_metrics_tracker()


def clear() -> None:
    """Forget recorded values (before a training schedule call)."""
    _tracker().clear()


def take_aux_loss(config, num_microbatches: int) -> float | None:
    """Collective over the world. The mean load-balancing loss of the schedule call since the last
    clear(), on every rank; None when the model has no experts or the loss is off (coeff 0).
    The records are cleared."""
    if not config.num_moe_experts or config.moe_aux_loss_coeff <= 0:
        return None
    metrics = _tracker().metrics
    entry = metrics[TRACKED] if TRACKED in metrics else None
    total = (entry.values.detach().sum().reshape(1).to(torch.float64) if entry is not None
             else torch.zeros(1, dtype=torch.float64))
    if entry is not None and entry.reduce_group is not None:
        parallel.all_reduce(total, group=entry.reduce_group)
    if parallel.pp_size() > 1:
        parallel.all_reduce(total, group=parallel.pp_group())
    total /= max(num_microbatches, 1)
    if parallel.dp_size() > 1:
        parallel.all_reduce(total, group=parallel.dp_group())
        total /= parallel.dp_size()
    moe_layers = sum(config.moe_layer_freq) if isinstance(config.moe_layer_freq, list) else config.num_layers
    clear()
    return float(total.item()) / max(moe_layers, 1)


__all__ = ["clear", "take_aux_loss"]
