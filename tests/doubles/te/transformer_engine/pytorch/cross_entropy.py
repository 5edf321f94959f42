"""Test double of transformer_engine/pytorch/cross_entropy.py (megatron's cross_entropy_loss_fusion;
this project computes its own log-probs). Not modelled: raises NotImplementedError."""

from transformer_engine.pytorch.unmodelled import unmodelled

parallel_cross_entropy = unmodelled("cross_entropy.parallel_cross_entropy")
