"""apex.contrib.layer_norm (apex/contrib/layer_norm/__init__.py): FastLayerNorm and its autograd
function FastLayerNormFN, over the fast_layer_norm extension."""

from apex.contrib.layer_norm.layer_norm import FastLayerNorm, FastLayerNormFN

__all__ = ["FastLayerNorm", "FastLayerNormFN"]
