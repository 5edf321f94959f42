"""Megatron models from a family's Architecture: the actor (GPTModel) and the critic (GPTModel
trunk + scalar value head), one chunk per virtual pipeline stage, for the parallel layout
megatron was initialized with (mcore/parallel.py). Every TransformerConfig field that describes
the model is set here, at construction; the training schedule's own fields are added where that
schedule is assembled (mcore/model.py, wrap_ddp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_providers import family_for
from vapo_megatron.mcore import parallel

# Megatron pads the vocabulary to a multiple of this times TP (make_vocab_size_divisible_by).
VOCAB_DIVISOR = 128
ACTIVATIONS = {"silu": F.silu}


def padded_vocab_size(hf_cfg: dict, tp: int) -> int:
    multiple = VOCAB_DIVISOR * tp
    return -(-hf_cfg["vocab_size"] // multiple) * multiple


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install
        return False
    return True


def apex_wgrad_available() -> bool:
    """Whether Apex's `fused_weight_gradient_mlp_cuda` extension imports (the pip route has no Apex;
    NGC images do)."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except Exception:  # ImportError, or an extension built for another torch
        return False
    return True


def wgrad_fusion(*, on_gpu: bool, te: bool, apex: bool) -> bool:
    """TransformerConfig.gradient_accumulation_fusion: only on the GPU with Transformer Engine AND
    Apex's fused_weight_gradient_mlp_cuda. TE's linear layers fuse by themselves, but the config is
    shared with megatron's own ColumnParallelLinear (GPTModel's output layer, also built for the
    critic before it is dropped), which raises at construction when the fusion is asked for and the
    Apex extension does not import (megatron/core/tensor_parallel/layers.py, ColumnParallelLinear
    __init__, `_grad_accum_fusion_available`). Megatron-LM's own argument checks turn it off the
    same way."""
    return on_gpu and te and apex


_ANNOUNCED: set[str] = set()


def _announce_once(line: str) -> None:
    """One start-up log line per distinct decision (transformer_config runs once per model chunk)."""
    if line not in _ANNOUNCED:
        _ANNOUNCED.add(line)
        if parallel.is_rank0():
            print(f"[vapo] {line}", flush=True)


def moe_settings(*, te: bool, aux_loss_coeff: float) -> dict:
    """TransformerConfig fields of a mixture-of-experts model beyond its architecture (the family
    gives experts, top-k, widths and the dense/MoE layer pattern)."""
    return dict(
        expert_model_parallel_size=parallel.ep_size(),  # expert TP is megatron's default: TP
        # Tokens go to the EP ranks holding their experts by all-to-all, and come back the same way.
        moe_token_dispatcher_type="alltoall",
        # TE's grouped GEMM runs all local experts in one kernel; megatron's SequentialMLP loops.
        moe_grouped_gemm=te,
        # Router scores in float32 whatever the parameter dtype, as transformers' Qwen3-MoE router.
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        # No token dropping (capacity factor None): every token reaches its top-k experts, as in
        # the rollout engine, so trainer and engine compute the same function.
        moe_expert_capacity_factor=None,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def transformer_config(hf_cfg: dict, *, params_dtype: torch.dtype, recompute: bool = False, on_gpu: bool | None = None,
                       sequence_parallel: bool = False, moe_aux_loss_coeff: float = 0.0):
    """The family's TransformerConfig for the parallel layout megatron was initialized with.

    recompute: full activation recomputation. sequence_parallel: megatron's (only when TP > 1).
    moe_aux_loss_coeff: the router's load-balancing loss weight (MoE models; 0: none).
    on_gpu: None = whether CUDA is available; False builds a CPU-initialized model (under
    `torch.device("meta")`: shapes only, as vapo-plan and vapo-convert do)."""
    from megatron.core.transformer import TransformerConfig

    architecture = family_for(hf_cfg).architecture(hf_cfg)
    arch = architecture.transformer
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    tp, pp, vpp = parallel.tp_size(), parallel.pp_size(), parallel.vp_size()
    te = on_gpu and te_available()
    apex = on_gpu and apex_wgrad_available()
    fusion = wgrad_fusion(on_gpu=on_gpu, te=te, apex=apex)
    if on_gpu:
        _announce_once(f"gradient_accumulation_fusion={fusion} (Transformer Engine {'imports' if te else 'absent'}, "
                       f"Apex fused_weight_gradient_mlp_cuda {'imports' if apex else 'absent'}; both needed)")
    moe = moe_settings(te=te, aux_loss_coeff=moe_aux_loss_coeff) if architecture.num_experts else {}
    return TransformerConfig(
        **{**arch, "activation_func": ACTIVATIONS[arch["activation_func"]]},
        **moe,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        # Sequence parallelism shards the norm/dropout/residual activations [T, h] over TP along T;
        # it has nothing to shard without TP (megatron refuses it there, Megatron-LM turns it off).
        sequence_parallel=sequence_parallel and tp > 1,
        virtual_pipeline_model_parallel_size=vpp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # CPU: every fused kernel off (they are CUDA-only). GPU: megatron's fused bias-SwiGLU and
        # bias-dropout-add; RoPE fusion needs Transformer Engine, wgrad accumulation fusion TE and
        # Apex (wgrad_fusion).
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        apply_rope_fusion=te,
        gradient_accumulation_fusion=fusion,
        persist_layer_norm=False,
        # Full activation recomputation: each layer keeps only its input for the backward pass
        # and recomputes the rest (a 32B model's activations at ~20k tokens per micro-batch do not
        # fit otherwise; vapo-plan estimates both ways).
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )


def layer_spec(config, vp_stage: int | None = None):
    """Transformer Engine's spec on the GPU when it imports, megatron's local spec otherwise (a
    CPU-initialized model, e.g. tests or vapo-plan's meta-device shards, never gets TE modules).
    The local spec with sequence parallelism is a block spec with norms that support it
    (sp_norm.py); TE's norms support it themselves."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from vapo_megatron.mcore.sp_norm import local_block_spec, local_block_spec_of

    te = not config.use_cpu_initialization and te_available()
    if config.num_moe_experts:
        # Dense and expert layers differ (moe_layer_freq): megatron's per-layer block spec.
        block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm",
                                                 vp_stage=vp_stage)
        return local_block_spec_of(block.layer_specs) if config.sequence_parallel and not te else block
    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    if config.sequence_parallel:
        return local_block_spec(spec, get_num_layers_to_build(config, vp_stage=vp_stage))
    return spec


def _gpt_kwargs(hf_cfg: dict, config, vp_stage: int | None) -> dict:
    arch = family_for(hf_cfg).architecture(hf_cfg)
    return dict(
        config=config,
        transformer_layer_spec=layer_spec(config, vp_stage),
        vocab_size=padded_vocab_size(hf_cfg, config.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel.is_stage(True, vp_stage),
        post_process=parallel.is_stage(False, vp_stage),
        parallel_output=True,  # logits stay vocab-parallel [B, T, V_padded / TP]
        position_embedding_type="rope",
        rotary_base=arch.rotary_base,
        # Llama 3.1's llama3 frequency scaling: megatron fixes its other parameters, and the
        # family refuses configs that state others (model_providers/llama.py).
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor if arch.rope_scaling_factor is not None else 8.0,
        vp_stage=vp_stage,
    )


def build_actor(hf_cfg: dict, *, params_dtype: torch.dtype, vp_stage: int | None = None, recompute: bool = False,
                on_gpu: bool | None = None, sequence_parallel: bool = False, moe_aux_loss_coeff: float = 0.0):
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(hf_cfg, params_dtype=params_dtype, recompute=recompute, on_gpu=on_gpu,
                                sequence_parallel=sequence_parallel, moe_aux_loss_coeff=moe_aux_loss_coeff)
    tied = family_for(hf_cfg).architecture(hf_cfg).tied_embeddings
    return GPTModel(share_embeddings_and_output_weights=tied, **_gpt_kwargs(hf_cfg, config, vp_stage))


def fresh_value_head(config) -> dict[str, torch.Tensor]:
    """The critic's initial value head {"weight": [1, H], "bias": [1]} (float32, CPU).

    Identical on every rank whatever the RNG state (TP replicas must agree); replaced when the HF
    checkpoint has a trained `score` head. vapo-convert, which builds the critic on the meta
    device, writes these values for a critic made from a causal LM."""
    gen = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(1, config.hidden_size, generator=gen) * config.init_method_std,
            "bias": torch.zeros(1)}


def build_critic(hf_cfg: dict, *, params_dtype: torch.dtype, vp_stage: int | None = None, recompute: bool = False,
                 on_gpu: bool | None = None, sequence_parallel: bool = False, moe_aux_loss_coeff: float = 0.0):
    from vapo_megatron.mcore.critic_model import CriticModel

    config = transformer_config(hf_cfg, params_dtype=params_dtype, recompute=recompute, on_gpu=on_gpu,
                                sequence_parallel=sequence_parallel, moe_aux_loss_coeff=moe_aux_loss_coeff)
    return CriticModel(**_gpt_kwargs(hf_cfg, config, vp_stage))


def build_chunks(hf_cfg: dict, *, params_dtype: torch.dtype, critic: bool, recompute: bool = False,
                 on_gpu: bool | None = None, sequence_parallel: bool = False, moe_aux_loss_coeff: float = 0.0) -> list:
    """One model chunk per virtual stage (a single chunk without VPP)."""
    vpp = parallel.vp_size()
    build = build_critic if critic else build_actor
    kwargs = dict(params_dtype=params_dtype, recompute=recompute, on_gpu=on_gpu, sequence_parallel=sequence_parallel,
                  moe_aux_loss_coeff=moe_aux_loss_coeff)
    if vpp is None:
        return [build(hf_cfg, **kwargs)]
    return [build(hf_cfg, vp_stage=v, **kwargs) for v in range(vpp)]


__all__ = ["apex_wgrad_available", "build_actor", "build_chunks", "build_critic", "fresh_value_head", "layer_spec", "padded_vocab_size",
           "te_available", "transformer_config", "wgrad_fusion"]
