"""Test double of transformer_engine/pytorch/cpu_offload.py: megatron's TransformerBlock asks it for
an offload context at construction (megatron/core/transformer/transformer_block.py). With offloading
off TE gives a context that does nothing; offloading itself is not modelled."""

from __future__ import annotations

import contextlib


def get_cpu_offload_context(enabled: bool = False, num_layers: int = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False,
                            double_buffering: bool = False, retain_pinned_cpu_buffers: bool = False, **kwargs):
    """(context, sync function) as cpu_offload.py `get_cpu_offload_context` returns them."""
    if enabled:
        raise NotImplementedError("test double: TE's CPU offloading is not modelled")
    return contextlib.nullcontext(), (lambda tensor: tensor)


__all__ = ["get_cpu_offload_context"]
