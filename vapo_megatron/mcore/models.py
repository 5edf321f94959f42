"""Megatron models from a family's Architecture: the actor (GPTModel) and the critic (GPTModel
trunk + scalar value head), one chunk per virtual pipeline stage, for the parallel layout
megatron was initialized with (mcore/parallel.py). Every TransformerConfig field that describes
the model is set here, at construction; the training schedule's own fields are added where that
schedule is assembled (mcore/model.py, wrap_ddp).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import shutil

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
    """megatron-core's own answer (megatron/core/extensions/transformer_engine.py HAVE_TE: whether
    `transformer_engine.pytorch` imports), which also picks the modules of its layer specs. A bare
    `import transformer_engine` is not enough: TE's `__init__` survives a torch extension that does
    not load, and the spec, the fusions and the log line would then disagree with megatron."""
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception:  # noqa: BLE001 - a broken CUDA install may raise anything while importing
        return False
    return bool(HAVE_TE)


# Never set by the commands: Transformer Engine's layer spec on the CPU, for the suite's TE world,
# where TE's modules are pure-torch stand-ins of the library (docs/what_ran_where.md).
TE_SPEC_ON_CPU = "VAPO_TE_SPEC_ON_CPU"


def te_spec(on_gpu: bool | None) -> bool:
    """Whether a model gets Transformer Engine's layer spec (and the TE-only settings that go with
    it: RoPE fusion, grouped-GEMM experts): where megatron-core sees TE (te_available) and the model
    is built for the GPU. on_gpu None lets the hardware decide (the trainer, vapo-eval): CUDA, or
    on the CPU the tests' switch VAPO_TE_SPEC_ON_CPU=1; a model built on the CPU on purpose
    (on_gpu=False: vapo-convert, vapo-plan) keeps megatron's local spec, as on a GPU node."""
    if on_gpu is None:
        on_gpu = torch.cuda.is_available() or os.environ.get(TE_SPEC_ON_CPU) == "1"
    return on_gpu and te_available()


def broken_te_line(te: bool) -> str | None:
    """One log line when Transformer Engine is installed but megatron-core cannot use it (the
    start-up's accelerator line, config/quiet.py, only sees that it is installed), else None."""
    if te or importlib.util.find_spec("transformer_engine") is None:
        return None
    return ("Transformer Engine is installed but megatron-core cannot use it (transformer_engine.pytorch does not "
            "import): megatron's local layer spec, no Transformer Engine fusions")


def _imports(*modules: str) -> bool:
    try:
        for name in modules:
            importlib.import_module(name)
    except Exception:  # noqa: BLE001 - ImportError, or an extension built for another torch
        return False
    return True


# Apex's CUDA extensions behind megatron's fused masked softmax (megatron/core/fusions/fused_softmax.py:
# the causal kernel, and the one whose get_batch_per_block decides whether the kernel applies).
SOFTMAX_EXTENSIONS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda")
# C compilers torch.compile's Inductor/Triton backend may call at a compiled function's first run.
COMPILERS = ("cc", "gcc", "clang")


def apex_softmax_available() -> bool:
    """Whether Apex's fused-softmax CUDA extensions import (only Apex's CUDA build has them)."""
    return _imports(*SOFTMAX_EXTENSIONS)


def softmax_fusion(*, on_gpu: bool, apex_softmax: bool) -> bool:
    """TransformerConfig.masked_softmax_fusion: only on the GPU with Apex's softmax extensions.
    With megatron's local spec, DotProductAttention's FusedScaleMaskSoftmax imports them at the first
    bf16/fp16 forward whose shape the kernel takes (16 < seq <= 4096, seq % 4 == 0), which raises
    where Apex is absent (the pip route); TE's attention does not read the field."""
    return on_gpu and apex_softmax


def host_compiler() -> str | None:
    """The host C compiler torch.compile would find: $CC when it names one on PATH, else cc, gcc, clang."""
    for name in ((os.environ.get("CC") or "").split()[:1] + list(COMPILERS)):
        found = shutil.which(name)
        if found:
            return found
    return None


def compiled_fusions(*, on_gpu: bool, compiler: str | None) -> bool:
    """TransformerConfig.bias_activation_fusion and bias_dropout_fusion: megatron-core 0.19.2 wraps
    their kernels (fusions/fused_bias_swiglu.py, fused_bias_dropout.py) in jit_fuser, which is
    torch.compile (megatron/core/jit.py); the first forward compiles them, which needs a host C
    compiler. Without one they are off (the same math, unfused)."""
    return on_gpu and compiler is not None


def apex_wgrad_available() -> bool:
    """Whether Apex's `fused_weight_gradient_mlp_cuda` extension imports (the pip route has no Apex;
    NGC images do)."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except Exception:  # ImportError, or an extension built for another torch
        return False
    return True


# Never set by the commands: gradient_accumulation_fusion on the CPU where a GPU node would have
# it, for the suite's TE-and-Apex world, TE's linears and Apex's fused_weight_gradient_mlp_cuda
# being pure-torch stand-ins there (docs/what_ran_where.md), so that the
# accumulation into main_grad every node with TE and Apex runs is exercised; "0" or unset: off.
WGRAD_FUSION_ON_CPU = "VAPO_WGRAD_FUSION_ON_CPU"


def wgrad_fusion_hardware(on_gpu: bool | None) -> bool:
    """wgrad_fusion's hardware condition: a model built for the GPU, or, where the hardware decides
    (on_gpu None) and there is none, the tests' switch VAPO_WGRAD_FUSION_ON_CPU=1."""
    if on_gpu is None:
        return torch.cuda.is_available() or os.environ.get(WGRAD_FUSION_ON_CPU) == "1"
    return on_gpu


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
                       sequence_parallel: bool = False, moe_aux_loss_coeff: float = 0.0, deterministic: bool = False):
    """The family's TransformerConfig for the parallel layout megatron was initialized with.

    recompute: full activation recomputation. sequence_parallel: megatron's (only when TP > 1).
    moe_aux_loss_coeff: the router's load-balancing loss weight (MoE models; 0: none).
    deterministic: trainer.deterministic, megatron's deterministic_mode (its deterministic embedding
    backward; TE's attention then requires NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, config/determinism.py).
    on_gpu: None = whether CUDA is available; False builds a CPU-initialized model (under
    `torch.device("meta")`: shapes only, as vapo-plan and vapo-convert do)."""
    from megatron.core.transformer import TransformerConfig

    architecture = family_for(hf_cfg).architecture(hf_cfg)
    arch = architecture.transformer
    te = te_spec(on_gpu)
    fusion_hardware = wgrad_fusion_hardware(on_gpu)
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    tp, pp, vpp = parallel.tp_size(), parallel.pp_size(), parallel.vp_size()
    apex = fusion_hardware and apex_wgrad_available()
    fusion = wgrad_fusion(on_gpu=fusion_hardware, te=te, apex=apex)
    softmax = softmax_fusion(on_gpu=on_gpu, apex_softmax=on_gpu and apex_softmax_available())
    compiler = host_compiler() if on_gpu else None
    compiled = compiled_fusions(on_gpu=on_gpu, compiler=compiler)
    if on_gpu or fusion:
        if line := broken_te_line(te):
            _announce_once(line)
        _announce_once(f"gradient_accumulation_fusion={fusion} (Transformer Engine {'imports' if te else 'absent'}, "
                       f"Apex fused_weight_gradient_mlp_cuda {'imports' if apex else 'absent'}; both needed)")
    if on_gpu:
        _announce_once(f"masked_softmax_fusion={softmax} (Apex {'/'.join(SOFTMAX_EXTENSIONS)} "
                       f"{'import' if softmax else 'absent'})")
        if not compiled:
            _announce_once(f"bias_activation_fusion=False bias_dropout_fusion=False: no host C compiler for "
                           f"torch.compile (CC, {', '.join(COMPILERS)}: none found)")
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
        # The interleaved schedule at PP=2: a stage's previous and next stage are one rank, and a
        # batched send to both directions pairs the activation with the gradient (megatron's
        # p2p_communication.py; NVIDIA/Megatron-LM#750). overlap_p2p_comm splits the steady state's
        # forward and backward exchanges into calls of one direction each; it excludes batch_p2p_comm.
        overlap_p2p_comm=vpp is not None,
        batch_p2p_comm=vpp is None,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # Under torch.device("meta") (vapo-plan, vapo-convert) there are no values to initialize:
        # megatron's init would still run every normal_ through torch's Python decompositions.
        perform_initialization=torch.get_default_device().type != "meta",
        # CPU: every fused kernel off (they are CUDA-only). GPU: megatron's fused bias-SwiGLU and
        # bias-dropout-add when torch.compile has a C compiler (compiled_fusions); the masked softmax
        # with Apex's extensions (softmax_fusion); RoPE fusion needs Transformer Engine, wgrad
        # accumulation fusion TE and Apex (wgrad_fusion).
        bias_activation_fusion=compiled,
        bias_dropout_fusion=compiled,
        masked_softmax_fusion=softmax,
        apply_rope_fusion=te,
        gradient_accumulation_fusion=fusion,
        persist_layer_norm=False,
        # Full activation recomputation: each layer keeps only its input for the backward pass
        # and recomputes the rest (a 32B model's activations at ~20k tokens per micro-batch do not
        # fit otherwise; vapo-plan estimates both ways).
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        deterministic_mode=deterministic,
        # The spec layer_spec builds: megatron's own record of the choice (te_spec).
        transformer_impl="transformer_engine" if te else "local",
    )


def layer_spec(config, vp_stage: int | None = None):
    """The block spec of one model chunk: Transformer Engine's layers when transformer_config chose
    them (te_spec: on the GPU when TE imports), megatron's local layers otherwise (vapo-convert's
    and vapo-plan's CPU-initialized models never get TE modules). Every norm, the final one
    included, is named here rather than left to megatron's import-time defaults
    (sp_norm.local_block_spec_of): TENorm with TE's layers, torch's RMSNorm (or sp_norm's, under
    sequence parallelism) with the local ones."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from vapo_megatron.mcore.sp_norm import local_block_spec, local_block_spec_of

    te = config.transformer_impl == "transformer_engine"
    sp = config.sequence_parallel
    if config.num_moe_experts:
        # Dense and expert layers differ (moe_layer_freq): megatron's per-layer block spec.
        block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm",
                                                 vp_stage=vp_stage)
        if te:
            return block  # its final norm is TENorm (gpt_layer_specs.py get_gpt_decoder_block_spec)
        return local_block_spec_of([te_checkpoint_keys(s) for s in block.layer_specs], sequence_parallel=sp)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if te:
        from megatron.core.extensions.transformer_engine import TENorm

        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
        return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=TENorm)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    return local_block_spec(spec, layers, sequence_parallel=sp)


def te_checkpoint_keys(layer_spec):
    """A local-spec layer whose checkpoint keys are the ones Transformer Engine's spec writes
    (issue 32 defect 3). megatron's local spec renames `pre_mlp_layernorm.*` to
    `mlp.linear_fc1.layer_norm_*` in every layer's sharded state dict: the name TE gives the norm it
    fuses into a dense MLP's first linear. An expert layer has no such linear, and TE's spec keeps
    its norm as `pre_mlp_layernorm` (megatron-core 0.19.2, gpt_layer_specs.py: TE's submodules have
    `pre_mlp_layernorm=TENorm if num_experts`). Without this, a Qwen3-MoE checkpoint written on a
    GPU could not be read where TE is absent (vapo-convert, vapo-eval, a resume on the CPU), nor
    a CPU one on a GPU. Dense layers keep the rename: there both specs agree."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layer = layer_spec.submodules
    mlp = layer.mlp.func if isinstance(layer.mlp, functools.partial) else getattr(layer.mlp, "module", layer.mlp)
    if not (isinstance(mlp, type) and issubclass(mlp, MoELayer)):  # megatron 0.19.2: partial(MoELayer, ...)
        return layer_spec
    keys = {k: v for k, v in layer.sharded_state_dict_keys_map.items() if k != "pre_mlp_layernorm."}
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer, sharded_state_dict_keys_map=keys))


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
                on_gpu: bool | None = None, sequence_parallel: bool = False, moe_aux_loss_coeff: float = 0.0,
                deterministic: bool = False):
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(hf_cfg, params_dtype=params_dtype, recompute=recompute, on_gpu=on_gpu,
                                sequence_parallel=sequence_parallel, moe_aux_loss_coeff=moe_aux_loss_coeff,
                                deterministic=deterministic)
    tied = family_for(hf_cfg).architecture(hf_cfg).tied_embeddings
    return _placed(GPTModel(share_embeddings_and_output_weights=tied, **_gpt_kwargs(hf_cfg, config, vp_stage)))


def build_critic(hf_cfg: dict, *, params_dtype: torch.dtype, vp_stage: int | None = None, recompute: bool = False,
                 on_gpu: bool | None = None, sequence_parallel: bool = False, moe_aux_loss_coeff: float = 0.0,
                 deterministic: bool = False):
    from vapo_megatron.mcore.critic_model import CriticModel

    config = transformer_config(hf_cfg, params_dtype=params_dtype, recompute=recompute, on_gpu=on_gpu,
                                sequence_parallel=sequence_parallel, moe_aux_loss_coeff=moe_aux_loss_coeff,
                                deterministic=deterministic)
    return _placed(CriticModel(**_gpt_kwargs(hf_cfg, config, vp_stage)))


def _placed(model):
    """Every parameter in params_dtype and, on the GPU, on the current device: what megatron's
    parallel linears and embeddings do by themselves, and the local spec's norms do not
    (WrappedTorchNorm builds torch.nn.RMSNorm in float32 on the CPU whatever the config says).
    Found by the first GPU run (2026-11-26): without TE or Apex, DDP's first broadcast_params failed
    in NCCL on those CPU norms, and a bf16 model's fp32 norms shifted the optimizer's order-based
    parameter ids (Float16OptimizerWithFloat16Params counts only its float16 params), so the first
    checkpoint save failed ("Optimizer shape (64,) does not match model shape (128,)"). Megatron-LM
    does the same with Float16Module and `.cuda()` in its get_model."""
    dtype = model.config.params_dtype
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    if not model.config.use_cpu_initialization:
        model.cuda(torch.cuda.current_device())
    return model


def unwrap(chunk):
    """The megatron model of a chunk, DDP-wrapped or not."""
    # DDP / Float16Module wrappers keep the model under `.module`.
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def build_chunks(hf_cfg: dict, *, params_dtype: torch.dtype, critic: bool, recompute: bool = False,
                 on_gpu: bool | None = None, sequence_parallel: bool = False, moe_aux_loss_coeff: float = 0.0,
                 deterministic: bool = False) -> list:
    """One model chunk per virtual stage (a single chunk without VPP)."""
    vpp = parallel.vp_size()
    build = build_critic if critic else build_actor
    kwargs = dict(params_dtype=params_dtype, recompute=recompute, on_gpu=on_gpu, sequence_parallel=sequence_parallel,
                  moe_aux_loss_coeff=moe_aux_loss_coeff, deterministic=deterministic)
    if vpp is None:
        return [build(hf_cfg, **kwargs)]
    return [build(hf_cfg, vp_stage=v, **kwargs) for v in range(vpp)]


__all__ = ["apex_softmax_available", "apex_wgrad_available", "broken_te_line", "build_actor", "build_chunks",
           "build_critic", "compiled_fusions", "host_compiler", "layer_spec", "padded_vocab_size", "softmax_fusion",
           "te_available", "te_spec", "TE_SPEC_ON_CPU", "te_checkpoint_keys", "transformer_config", "unwrap",
           "wgrad_fusion", "wgrad_fusion_hardware", "WGRAD_FUSION_ON_CPU"]
