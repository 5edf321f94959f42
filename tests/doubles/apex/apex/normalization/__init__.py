"""apex.normalization: only the autograd function megatron-core's FusedLayerNorm calls
(apex/normalization/fused_layer_norm.py); Apex's own FusedLayerNorm / FusedRMSNorm modules are not
modelled."""

from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction

__all__ = ["FusedLayerNormAffineFunction"]
