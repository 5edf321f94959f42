"""Test double of transformer_engine/pytorch/distributed.py: what megatron-core imports from it.

- activation_recompute_forward (line ~241): megatron's CheckpointFunction enters it around FP8
  recomputation; it only records whether a recompute region/phase is active.
- is_fp8_activation_recompute_enabled / in_fp8_activation_recompute_phase: FP8 is off here.
- checkpoint (TE's activation checkpointing, megatron's te_checkpoint, FP8 only) and
  CudaRNGStatesTracker (megatron's use_te_rng_tracker, CUDA graphs) are not modelled.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ContextDecorator

from transformer_engine.pytorch.unmodelled import UnmodelledModule, unmodelled

_IN_RECOMPUTE_REGION = False
_RECOMPUTE_PHASE = False


class activation_recompute_forward(AbstractContextManager, ContextDecorator):  # noqa: N801 - TE's name
    def __init__(self, activation_recompute: bool = False, recompute_phase: bool = False):
        super().__init__()
        self.activation_recompute = activation_recompute
        self.recompute_phase = recompute_phase

    def __enter__(self):
        global _IN_RECOMPUTE_REGION, _RECOMPUTE_PHASE
        _IN_RECOMPUTE_REGION = self.activation_recompute
        _RECOMPUTE_PHASE = self.recompute_phase

    def __exit__(self, *exc_details):
        global _IN_RECOMPUTE_REGION, _RECOMPUTE_PHASE
        _IN_RECOMPUTE_REGION = False
        _RECOMPUTE_PHASE = False


def is_fp8_activation_recompute_enabled() -> bool:
    return False  # _IN_RECOMPUTE_REGION and FP8 enabled; FP8 never is here


def in_fp8_activation_recompute_phase() -> bool:
    return _RECOMPUTE_PHASE


def get_all_rng_states() -> dict:
    """TE's own RNG tracker's states: none, as that tracker is never built here."""
    return {}


class CudaRNGStatesTracker(UnmodelledModule):
    """distributed.py `CudaRNGStatesTracker` (megatron's use_te_rng_tracker): not modelled."""


checkpoint = unmodelled("distributed.checkpoint")

__all__ = ["CudaRNGStatesTracker", "activation_recompute_forward", "checkpoint", "get_all_rng_states",
           "in_fp8_activation_recompute_phase", "is_fp8_activation_recompute_enabled"]
