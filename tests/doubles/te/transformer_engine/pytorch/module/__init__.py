"""Test double of transformer_engine/pytorch/module: TE's layers (base.py, linear.py,
layernorm_linear.py, grouped_linear.py, the norms), each citing the TE file it follows."""

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
from transformer_engine.pytorch.module.grouped_linear import GroupedLinear
from transformer_engine.pytorch.module.layernorm_linear import LayerNormLinear
from transformer_engine.pytorch.module.linear import Linear
from transformer_engine.pytorch.module.norms import LayerNorm, RMSNorm
from transformer_engine.pytorch.unmodelled import UnmodelledModule


class LayerNormMLP(UnmodelledModule):
    pass


class Fp8Padding(UnmodelledModule):
    pass


class Fp8Unpadding(UnmodelledModule):
    pass


__all__ = ["Fp8Padding", "Fp8Unpadding", "GroupedLinear", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear",
           "RMSNorm", "TransformerEngineBaseModule"]
