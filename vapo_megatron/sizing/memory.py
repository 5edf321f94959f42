"""Bytes per rank: pure functions of shapes (docs/slurm.md, "Sizing"), and the reserve.

  parameters   n * dtype bytes (model.dtype)
  gradients    n * 4: megatron DDP's main_grad buffers are float32 (grad_reduce_in_fp32)
  optimizer    Adam: n * 12 with bf16 params (fp32 master copy + 2 fp32 moments), n * 8 with fp32
               params (moments only); divided by DP with the distributed optimizer, the routed
               experts' share by expert-DP = DP / EP (parallel.ep)
  activations  of the model being trained, for one micro-batch of T = trainer.micro_batch_tokens
               tokens, times the micro-batches a pipeline stage holds at once; a mixture-of-experts
               layer adds its router and all-to-all terms (moe_layer_parts)
"""

from __future__ import annotations

import math

from model_providers.table import head_dim, query_groups
from vapo_megatron.config import Config
from vapo_megatron.config.engines import engine_of, engine_tp

GIB = float(1 << 30)


def state_bytes(n_params: int, *, dtype_bytes: int, dp: int, distributed_optimizer: bool, expert_params: int = 0,
                ep: int = 1) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) in bytes for `n_params` parameters on one rank, of
    which `expert_params` are routed experts. Every parameter on the rank has its own float32
    main_grad (megatron DDP keeps expert and dense grads in separate buffers, reduced over the
    expert-data-parallel and the data-parallel group). The distributed optimizer shards the dense
    state over DP and the experts' over expert-DP = DP / EP (DistributedOptimizer's per-buffer
    ranges over the buffer's own group: DDP's intra_expt_dp_group for expert buffers)."""
    params = n_params * dtype_bytes
    grads = n_params * 4  # DDP main_grad buffer, float32 (mcore/model.py, wrap_ddp: grad_reduce_in_fp32)
    per_param = 12 if dtype_bytes < 4 else 8  # fp32 master (bf16 params only) + Adam exp_avg + exp_avg_sq
    dense, experts = (n_params - expert_params) * per_param, expert_params * per_param
    if distributed_optimizer:
        return params, grads, math.ceil(dense / dp) + math.ceil(experts / (dp // ep))
    return params, grads, dense + experts


# ---- the reserve: what the trainer and the engine use besides tensors ---------------------------
# Estimates, not measured on a GPU here (docs/slurm.md says so); vapo-check measures
# torch.cuda.memory_reserved around the phase switches on a real GPU.
# A CUDA context with PyTorch's kernels (CUDA 12 lazy loading) and cuBLAS workspaces, per process
# on the GPU: the trainer's rank and the colocated engine's TP worker each have one, and the
# engine's stays while it has released its memory.
CUDA_CONTEXT_BYTES = int(0.75 * GIB)
# One NCCL communicator on a GPU: NCCL_BUFFSIZE (4 MiB) x send/recv x up to 32 channels over
# NVLink, about 0.25 GiB (NVLink SHARP adds more; off unless the job sets NCCL_NVLS_ENABLE=1).
# Counted for every group of more than one rank that the trainer uses (world, TP, PP, DP) and the
# engine's TP group.
NCCL_COMMUNICATOR_BYTES = int(0.25 * GIB)
# PyTorch's caching allocator: the contiguous buffers (parameters, main_grad, optimizer state)
# are allocated once; activations vary in size with every packed micro-batch and fragment the
# cache: a quarter of the peak activations is kept for that during training. At the switch to
# rollout the cache is emptied on every rank of an engine before its owner resumes the KV cache
# (mcore/memory.py, Generator.generate's sync_freed barrier), after megatron-core's own caches
# (GlobalMemoryBuffer, the RoPE embeddings) are dropped, leaving only blocks pinned by live small
# tensors.
FRAGMENTATION_FRACTION = 0.25
ROLLOUT_CACHE_BYTES = int(0.5 * GIB)
ROLLOUT_CACHE_ITEM = "allocator: blocks pinned by live small tensors"
# SGLang's memory outside mem_fraction_static (its forward activations, CUDA graph buffers,
# sampling): its static share holds weights + KV cache only.
SGLANG_RUNTIME_BYTES = int(1.5 * GIB)
# Allocated by the engine while it generates, after the KV cache is back: not something that
# remains of the trainer when the owner resumes (plan.py, RankMemory.kv_resume).
SGLANG_RUNTIME_ITEM = "SGLang buffers outside its static share"


# While its weights are released, SGLang keeps a clone of every buffer of its model on the GPU,
# outside its memory saver (sglang 0.5.23, scheduler_components/weight_updater.py:
# release_memory_occupation stores _export_static_state's `buffer.detach().clone()` until the
# weights resume): through the whole training phase. A decoder's buffers are its rotary cos/sin
# cache, float32 [max_position_embeddings, head_dim].
SGLANG_STASH_ITEM = "SGLang's stashed model buffers (RoPE cos/sin cache)"


def sglang_stash_bytes(hf_cfg: dict) -> int:
    """The engine's model buffers that SGLang clones at release (float32 [max positions, head_dim])."""
    return hf_cfg["max_position_embeddings"] * head_dim(hf_cfg) * 4


def critic_group_count(actor: tuple[int, int, int, int], critic: tuple[int, int, int, int]) -> int:
    """The NCCL communicators a critic at its own layout (critic.parallel) adds: its groups of more
    than one rank, (tp, pp, dp, ep) each, that are not the actor's. In megatron's rank order a TP
    group's ranks depend on TP alone, a PP group's on PP, a DP group's on TP and PP, the expert
    groups' (EP, TP x EP, expert-DP) on TP and EP (and PP for expert-DP); a group of the same
    ranks is assumed shared, every other one a communicator of its own."""
    def groups(tp: int, pp: int, dp: int, ep: int) -> dict:
        out = {("tp", tp): tp, ("pp", pp): pp, ("dp", tp, pp): dp}
        if ep > 1:
            out.update({("ep", tp, ep): ep, ("tp-ep", tp, ep): tp * ep if tp > 1 else 1,
                        ("expert-dp", tp, pp, ep): dp // ep})
        return out
    theirs = groups(*actor)
    return sum(size > 1 for key, size in groups(*critic).items() if key not in theirs)


def reserve_parts(cfg: Config, *, world_size: int, dp: int, activations: int, phase: str,
                  engine_stash: int = 0, replay_bytes: int = 0, critic_groups: int = 0) -> dict[str, int]:
    """Bytes one GPU needs besides the counted tensors in `phase` ("training" or "rollout");
    `activations` is the training peak's (the model being trained); `engine_stash` the colocated
    engine's stashed buffers (sglang_stash_bytes), held while training; `replay_bytes` routing
    replay's device item (route_parts), while training; `critic_groups` the communicators of a critic
    at its own layout (critic_group_count). With EP > 1 the MoE layers
    add the EP group (the dispatcher's all-to-all), the TP x EP group (its token counts, TP > 1)
    and the expert-DP group (DDP's expert gradients, DP / EP > 1)."""
    tp, pp, ep, colocated = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, engine_of(cfg).colocated
    expert_groups = (ep, tp * ep if tp > 1 else 1, dp // ep) if ep > 1 else ()
    groups = (sum(size > 1 for size in (world_size, tp, pp, dp, *expert_groups))
              + (colocated and engine_tp(cfg) > 1))
    parts = {"CUDA context, trainer": CUDA_CONTEXT_BYTES}
    if colocated:
        parts["CUDA context, engine"] = CUDA_CONTEXT_BYTES
    parts[f"NCCL buffers ({groups} communicators)"] = groups * NCCL_COMMUNICATOR_BYTES
    if critic_groups:  # critic.parallel: its own TP/PP/DP groups (critic_group_count)
        parts[f"NCCL buffers, the critic's own groups ({critic_groups})"] = critic_groups * NCCL_COMMUNICATOR_BYTES
    if phase == "training":
        parts[f"allocator cache ({FRAGMENTATION_FRACTION:g} x activations)"] = int(FRAGMENTATION_FRACTION * activations)
        if colocated:
            parts[SGLANG_STASH_ITEM] = engine_stash
        if replay_bytes:
            parts[ROUTES_DEVICE_ITEM] = replay_bytes
    else:
        parts[ROLLOUT_CACHE_ITEM] = ROLLOUT_CACHE_BYTES
        if colocated:
            parts[SGLANG_RUNTIME_ITEM] = SGLANG_RUNTIME_BYTES
    return parts


def checkpoint_bytes(n_params: int, *, dtype_bytes: int) -> int:
    """One saved checkpoint, all ranks together, of the `n_params` parameters of the models it saves
    (actor, and critic unless algo.estimator=grpo): every parameter once in the model's dtype, plus
    Adam's state (fp32 master copy with bf16 parameters, exp_avg, exp_avg_sq); no gradients."""
    per_param = dtype_bytes + (12 if dtype_bytes < 4 else 8)
    return n_params * per_param


SAVE_HOST, SAVE_GPU, LOAD_HOST, LOAD_GPU = "save, host", "save, GPU", "load, host", "load, GPU"


def checkpoint_parts(*, params: int, expert_params: int, written_params: int, largest: int, merged: int,
                     dtype_bytes: int, dp: int, ep: int, distributed_optimizer: bool) -> dict[str, int]:
    """What saving and loading one model's checkpoint costs one rank at its DP rank 0, in bytes,
    beyond the state it holds (checkpoint/model_state.py, optimizer_state.py):
      save, host   the copy of everything the rank writes, which megatron's writer stages before it
                   writes (filesystem_async.py preload_tensors: a D2H copy of each tensor): its
                   `written_params` weights (DP rank 0 writes its stage's weights, the TP-replicated
                   ones on TP rank 0) in their dtype, and its Adam state: with the distributed
                   optimizer its own share, float32 main parameters and both moments (12 bytes a
                   parameter, also with float32 parameters), no other rank's; without it the whole
                   state of its weights (12 bytes with bf16 parameters, 8 with float32: no copy)
      save, GPU    nothing: what is written is the tensors themselves or views of them
      load, host   one stored tensor at a time (torch DCP reads a stored chunk, then copies it into
                   place): at most the largest parameter on the rank, as float32 Adam state
      load, GPU    the larger of megatron's SwiGLU merges (a new linear_fc1 of every layer, from its
                   loaded gate and up halves, until the weights are set: `merged` elements) and the
                   fused Adams' load_state_dict, which sets every moment anew from the loaded one
                   (TE's FusedAdam, every GPU node: two float32 moments of the rank's Adam state)
    The rank's own share of a distributed optimizer's state is its dense parameters / DP and its
    routed experts' / expert-DP (state_bytes); a load reads only that share."""
    if distributed_optimizer:
        adam = math.ceil((params - expert_params) / dp) + math.ceil(expert_params / (dp // ep))
        written_adam = 12 * adam
    else:
        adam, written_adam = params, written_params * (12 if dtype_bytes < 4 else 8)
    return {SAVE_HOST: written_params * dtype_bytes + written_adam, SAVE_GPU: 0, LOAD_HOST: 4 * largest,
            LOAD_GPU: max(merged * dtype_bytes, 8 * adam)}


# The named activation items of a mixture-of-experts layer (moe_layer_parts), as the report prints them.
MOE_ROUTER = "MoE router logits + probs [T/s, E] fp32"
MOE_DISPATCH = "MoE all-to-all dispatch [T*k, h]"
MOE_EXPERT_MLP = "MoE expert MLP [T*k, 3f_e/t]"
MOE_COMBINE = "MoE all-to-all combine [T*k, h], transient"
MOE_ITEMS = (MOE_ROUTER, MOE_DISPATCH, MOE_EXPERT_MLP, MOE_COMBINE)


def moe_architecture(hf_cfg: dict) -> dict | None:
    """The MoE fields megatron gets (num_moe_experts, moe_router_topk, moe_ffn_hidden_size), from
    the model family (model_providers); None for a dense model."""
    from model_providers import family_for

    arch = family_for(hf_cfg).architecture(hf_cfg)
    return arch.transformer if arch.num_experts else None


def moe_layer_parts(hf_cfg: dict, *, tokens: int, tp: int, dtype_bytes: int,
                    sequence_parallel: bool = False) -> dict[str, int]:
    """A mixture-of-experts layer's MLP activations on one rank for `tokens` tokens, in place of the
    dense MLP's 3f/TP ({} for a dense model). E experts, top-k routing, expert width f_e; megatron's
    MoEAlltoAllTokenDispatcher (megatron/core/transformer/moe/token_dispatcher.py) with no token
    dropping (mcore/models.py, moe_settings); routing assumed balanced (each EP rank receives its
    share; an EP rank whose experts are popular receives more):
      router    logits [T/s, E] from TopKRouter.gating (router_gating_linear, float32 by
                moe_router_dtype="fp32") and the routing probs [T/s, E], kept for backward;
                T/s: the tokens entering the layer on this rank (s = TP with sequence parallelism)
      dispatch  the T/s x k routed copies of this rank's tokens: permuted (dispatch_preprocess),
                sent to the EP ranks of their experts by all_to_all (token_dispatch), gathered over
                TP (dispatch_postprocess): T x k tokens [T*k, h] enter this rank's local experts,
                linear_fc1's input, kept for its weight gradient
      expert    linear_fc1's output [T*k, 2 f_e / t] (gate and up) and the probability-weighted
                SwiGLU output [T*k, f_e / t] (linear_fc2's input) of the local experts
      combine   linear_fc2's output [T*k, h] going back: reduce-scatter over TP (combine_preprocess),
                all_to_all over EP (token_combine), unpermute (combine_postprocess); not kept for
                backward, and its gradient returns the same way: one per rank, for the layer
                being computed (a transient, not per stored layer)"""
    moe = moe_architecture(hf_cfg)
    if moe is None:
        return {}
    h, k, f = hf_cfg["hidden_size"], moe["moe_router_topk"], moe["moe_ffn_hidden_size"]
    routed = tokens * k
    return {MOE_ROUTER: 2 * 4 * (tokens // tp if sequence_parallel else tokens) * moe["num_moe_experts"],
            MOE_DISPATCH: dtype_bytes * routed * h,
            MOE_EXPERT_MLP: dtype_bytes * routed * 3 * f // tp,
            MOE_COMBINE: dtype_bytes * routed * h}


def layer_activation_bytes(hf_cfg: dict, *, tokens: int, tp: int, dtype_bytes: int,
                           sequence_parallel: bool = False) -> int:
    """Activations one transformer layer keeps for its backward pass, nothing recomputed, for
    `tokens` tokens on one TP rank (flash/fused attention: no T x T scores):
      4h          [T, h] tensors replicated over TP: input_layernorm's input, linear_qkv's input,
                  the residual entering pre_mlp_layernorm, linear_fc1's input; with sequence
                  parallelism each rank keeps its T/TP slice of them: 4h/TP
      (a+2g)d/TP  q, k, v (attention backward)
      ad/TP       attention output (kept by flash attention; also linear_proj's input)
      3f/TP       linear_fc1's output (gate and up) and the SwiGLU output (linear_fc2's input); in
                  a mixture-of-experts model the kept items of moe_layer_parts instead (router,
                  dispatch, expert MLP; its few dense layers, if any, are counted as MoE layers)
    Left out as small: softmax statistics, RMSNorm's per-token scale (dropout is 0: no masks)."""
    h, f = hf_cfg["hidden_size"], hf_cfg["intermediate_size"]
    a, g = hf_cfg["num_attention_heads"], query_groups(hf_cfg)
    d = head_dim(hf_cfg)
    moe = moe_layer_parts(hf_cfg, tokens=tokens, tp=tp, dtype_bytes=dtype_bytes, sequence_parallel=sequence_parallel)
    mlp = 0 if moe else 3 * f
    per_token = (4 * h // tp if sequence_parallel else 4 * h) + ((a + 2 * g) * d + a * d + mlp) // tp
    return dtype_bytes * tokens * per_token + sum(v for name, v in moe.items() if name != MOE_COMBINE)


def logprob_buffer_bytes(tokens: int, vocab_shard: int, chunk_tokens: int) -> int:
    """vocab_parallel's float32 work buffer: [min(chunk_tokens, tokens), vocab_shard]."""
    return 4 * min(chunk_tokens, tokens) * vocab_shard


def activation_parts(hf_cfg: dict, *, tokens: int, tp: int, pp: int, vpp: int | None, inflight_microbatches: int,
                     dtype_bytes: int, recompute: bool, logits_vocab: int, chunk_tokens: int,
                     sequence_parallel: bool = False) -> dict[str, int]:
    """Peak activations of one model on one rank, by name: "layers" (all but the MoE items),
    "logits", and for a mixture-of-experts model the MOE_ITEMS (moe_layer_parts) over the layers
    that keep them. recompute (full, uniform, one layer per group): each layer keeps only its input
    [T, h] ([T/TP, h] with sequence parallelism), and the layer being back-propagated is recomputed
    in full (its MoE items once). logits_vocab: the padded vocabulary on the last stage of the actor
    (0 elsewhere and for the critic, whose value head is [T, 1]): vocab-parallel logits [T, V/TP]
    and their gradient, for the one micro-batch the last stage holds, plus the log-prob kernel's one
    float32 work buffer [min(chunk_tokens, T), V/TP] (mcore/vocab_parallel.py;
    trainer.logprob_chunk_tokens). The MoE combine buffer is counted once (a transient)."""
    # Layers with stored activations: in-flight (chunk) micro-batches x layers per (virtual) stage.
    n_layers = inflight_microbatches * (hf_cfg["num_hidden_layers"] // (pp * (vpp or 1)))
    full_layer = layer_activation_bytes(hf_cfg, tokens=tokens, tp=tp, dtype_bytes=dtype_bytes,
                                        sequence_parallel=sequence_parallel)
    moe = moe_layer_parts(hf_cfg, tokens=tokens, tp=tp, dtype_bytes=dtype_bytes, sequence_parallel=sequence_parallel)
    kept_moe = sum(v for name, v in moe.items() if name != MOE_COMBINE)
    if recompute:
        kept = tokens * hf_cfg["hidden_size"] // (tp if sequence_parallel else 1)
        parts = {"layers": n_layers * dtype_bytes * kept + full_layer - kept_moe}
        layers_with_moe = 1
    else:
        parts = {"layers": n_layers * (full_layer - kept_moe)}
        layers_with_moe = n_layers
    parts.update({name: v * (1 if name == MOE_COMBINE else layers_with_moe) for name, v in moe.items()})
    parts["logits"] = (2 * dtype_bytes * tokens * (logits_vocab // tp)
                       + logprob_buffer_bytes(tokens, logits_vocab // tp, chunk_tokens))
    return parts


def activation_bytes(hf_cfg: dict, **kwargs) -> int:
    """Peak activations of one model on one rank: the sum of activation_parts(hf_cfg, **kwargs)."""
    return sum(activation_parts(hf_cfg, **kwargs).values())


ROUTES_DEVICE_ITEM = "routing replay ids [L, T/s, k], this stage"


def route_parts(cfg: Config, hf_cfg: dict, *, dp: int, inflight_microbatches: int) -> dict[str, int]:
    """Routing replay's routes on one rank ({} when off: data/routes.py, replays), at most (every
    sequence at data.max_prompt_tokens + rollout.max_new_tokens):
      host    the step's routes [tokens, moe_layers, k] in the smallest id dtype, held twice (the
              rollout's outputs, on every rank of the replica after its all-gather, and the packed
              batch), for every generation round of dynamic sampling; and a micro-batch's routes of
              the stage's MoE layers [L, T/s, k], pinned for the copy to the GPU
      device  that copy, the int64 ids [L, T/s, k] made from it (the routers' indices: one
              micro-batch's, or every in-flight one's when recomputation queues them for the
              backward) and one layer's float32 weights [T/s, k] while it routes (ROUTES_DEVICE_ITEM;
              s = TP with sequence parallelism; mcore/routing_replay.py), in the training reserve"""
    from vapo_megatron.data.routes import id_dtype, replays, route_shape

    shape = route_shape(hf_cfg)
    if shape is None or not replays(cfg, hf_cfg):
        return {}
    layers, k, experts = shape
    r, p = cfg.rollout, cfg.parallel
    rounds = r.max_sampling_rounds if r.dynamic_sampling else 1
    sequences = rounds * r.prompts_per_step * r.n_samples // max(dp, 1)
    tokens = cfg.data.max_prompt_tokens + r.max_new_tokens
    width = id_dtype(experts).itemsize
    step = 2 * sequences * tokens * layers * k * width
    local = cfg.trainer.micro_batch_tokens // (p.tp if p.sequence_parallel and p.tp > 1 else 1)
    queued = inflight_microbatches if cfg.model.recompute_activations else 1
    stage = -(-layers // p.pp) * local * k  # ids of one micro-batch, the stage's MoE layers
    return {f"host: the step's routes ({sequences:,} sequences x {tokens:,} tokens x {layers} MoE layers x {k})": step,
            "host: a micro-batch's routes, pinned for the copy": stage * width,
            ROUTES_DEVICE_ITEM: stage * width + queued * stage * 8 + local * k * 4}


__all__ = ["GIB", "LOAD_GPU", "LOAD_HOST", "MOE_COMBINE", "MOE_DISPATCH", "MOE_EXPERT_MLP", "MOE_ITEMS", "MOE_ROUTER",
           "ROLLOUT_CACHE_ITEM", "ROUTES_DEVICE_ITEM", "SAVE_GPU", "SAVE_HOST", "SGLANG_RUNTIME_ITEM",
           "activation_bytes", "activation_parts", "checkpoint_bytes", "checkpoint_parts", "critic_group_count",
           "layer_activation_bytes", "logprob_buffer_bytes", "moe_architecture", "moe_layer_parts", "reserve_parts",
           "route_parts", "state_bytes"]
