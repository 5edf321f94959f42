"""apex.contrib: only layer_norm (FastLayerNormFN, megatron-core's persistent LayerNorm kernel)."""
