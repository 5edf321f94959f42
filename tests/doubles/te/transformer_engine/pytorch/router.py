"""Test double of transformer_engine/pytorch/router.py: megatron's fused router kernels
(moe_router_fusion, off in this project). Not modelled: each raises NotImplementedError."""

from transformer_engine.pytorch.unmodelled import unmodelled

fused_topk_with_score_function = unmodelled("router.fused_topk_with_score_function")
fused_compute_score_for_moe_aux_loss = unmodelled("router.fused_compute_score_for_moe_aux_loss")
fused_moe_aux_loss = unmodelled("router.fused_moe_aux_loss")
