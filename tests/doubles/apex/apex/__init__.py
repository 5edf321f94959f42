"""Test double of the `apex` package (NVIDIA/apex 6424da3, the Apex of NGC's PyTorch images), pure
torch, never shipped: what megatron-core 0.19.2 imports from it on this project's paths.

Importing it is what turns megatron-core's HAVE_APEX on (transformer/transformer_block.py,
models/gpt/gpt_layer_specs.py, models/backends.py: FusedLayerNorm as the default LayerNorm). As
apex/__init__.py does (lines 14-15), it imports its optimizers and normalization; contrib is
imported only on request. The CUDA extensions Apex builds are top-level modules beside it
(tests/doubles/apex/: amp_C, fused_layer_norm_cuda, fast_layer_norm, the megatron softmax kernels,
fused_weight_gradient_mlp_cuda).

    optimizers/          FusedAdam (the lead's), FusedSGD
    normalization/       FusedLayerNormAffineFunction
    multi_tensor_apply/  multi_tensor_applier
    contrib/layer_norm/  FastLayerNormFN (megatron's persistent LayerNorm)
"""

from apex import normalization, optimizers

__all__ = ["optimizers", "normalization"]
