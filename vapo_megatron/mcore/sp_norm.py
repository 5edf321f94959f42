"""RMSNorm for megatron's local layer spec (no Transformer Engine, no Apex) that also works with
sequence parallelism.

Under sequence parallelism each TP rank normalizes only its slice of the sequence [T/TP, B, H],
so the gradient of a norm's weight on one rank is a partial sum over tokens. Megatron's Apex and
TE norms mark their weights with `sequence_parallel`, and `finalize_model_grads` then sums those
gradients over the TP group; megatron's torch fallback (WrappedTorchNorm) refuses sequence
parallelism instead. This is torch's RMSNorm with that mark: the same arithmetic, and the same
parameter name (`weight`), so checkpoints and the HF name table are unchanged.
"""

from __future__ import annotations

import dataclasses

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm needs normalization='RMSNorm', got {config.normalization!r}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def local_block_spec(layer_spec, num_layers: int):
    """Megatron's local layer spec with every torch norm replaced (input, pre-MLP and q/k norms),
    as a block spec whose final norm is one too: all of them see sequence-parallel activations."""
    return local_block_spec_of([layer_spec] * num_layers)


def local_block_spec_of(layer_specs: list):
    """local_block_spec for a block whose layers differ (a MoE model's dense and expert layers)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def swap(submodules, *fields):
        changes = {f: SequenceParallelRMSNorm for f in fields if getattr(submodules, f) is WrappedTorchNorm}
        return dataclasses.replace(submodules, **changes)

    def swap_layer(layer_spec):
        layer = layer_spec.submodules
        attention = dataclasses.replace(
            layer.self_attention, submodules=swap(layer.self_attention.submodules, "q_layernorm", "k_layernorm"))
        layer = dataclasses.replace(swap(layer, "input_layernorm", "pre_mlp_layernorm"), self_attention=attention)
        return dataclasses.replace(layer_spec, submodules=layer)

    return TransformerBlockSubmodules(layer_specs=[swap_layer(s) for s in layer_specs], layer_norm=SequenceParallelRMSNorm)
