"""Bytes per rank: pure functions of shapes (docs/slurm.md, "Sizing"), and the reserve.

  parameters   n * dtype bytes (model.dtype)
  gradients    n * 4: megatron DDP's main_grad buffers are float32 (grad_reduce_in_fp32)
  optimizer    Adam: n * 12 with bf16 params (fp32 master copy + 2 fp32 moments), n * 8 with fp32
               params (moments only); divided by DP with the distributed optimizer
  activations  of the model being trained, for one micro-batch of T = trainer.micro_batch_tokens
               tokens, times the micro-batches a pipeline stage holds at once
"""

from __future__ import annotations

import math

from model_providers.table import head_dim, query_groups
from vapo_megatron.config import Config

GIB = float(1 << 30)


def state_bytes(n_params: int, *, dtype_bytes: int, dp: int, distributed_optimizer: bool) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) in bytes for `n_params` parameters on one rank."""
    params = n_params * dtype_bytes
    grads = n_params * 4  # DDP main_grad buffer, float32 (mcore/model.py, wrap_ddp: grad_reduce_in_fp32)
    per_param = 12 if dtype_bytes < 4 else 8  # fp32 master (bf16 params only) + Adam exp_avg + exp_avg_sq
    optim = n_params * per_param
    if distributed_optimizer:
        optim = math.ceil(optim / dp)
    return params, grads, optim


# ---- the reserve: what the trainer and the engine use besides tensors ---------------------------
# Estimates, not measured on a GPU here (docs/slurm.md says so); scripts/gpu_check.py measures
# torch.cuda.memory_reserved around the phase switches on a real GPU.
# A CUDA context with PyTorch's kernels (CUDA 12 lazy loading) and cuBLAS workspaces, per process
# on the GPU: the trainer's rank and the colocated engine's TP worker each have one, and the
# engine's stays while it has released its memory.
CUDA_CONTEXT_BYTES = int(0.75 * GIB)
# One NCCL communicator on a GPU: NCCL_BUFFSIZE (4 MiB) x send/recv x up to 32 channels over
# NVLink, about 0.25 GiB (NVLink SHARP, NCCL_NVLS_ENABLE, can add more). Counted for every group
# of more than one rank that the trainer uses (world, TP, PP, DP) and the engine's TP group.
NCCL_COMMUNICATOR_BYTES = int(0.25 * GIB)
# PyTorch's caching allocator: the contiguous buffers (parameters, main_grad, optimizer state)
# are allocated once; activations vary in size with every packed micro-batch and fragment the
# cache: a quarter of the peak activations is kept for that during training. At the switch to
# rollout the cache is emptied on every rank of an engine before its owner resumes the KV cache
# (mcore/memory.py, Generator.generate's sync_freed barrier), leaving only blocks pinned by live
# small tensors.
FRAGMENTATION_FRACTION = 0.25
ROLLOUT_CACHE_BYTES = int(0.5 * GIB)
ROLLOUT_CACHE_ITEM = "allocator: blocks pinned by live small tensors"
# SGLang's memory outside mem_fraction_static (its forward activations, CUDA graph buffers,
# sampling): its static share holds weights + KV cache only.
SGLANG_RUNTIME_BYTES = int(1.5 * GIB)
# Allocated by the engine while it generates, after the KV cache is back: not something that
# remains of the trainer when the owner resumes (plan.py, RankMemory.kv_resume).
SGLANG_RUNTIME_ITEM = "SGLang buffers outside its static share"


def reserve_parts(cfg: Config, *, world_size: int, dp: int, activations: int, phase: str) -> dict[str, int]:
    """Bytes one GPU needs besides the counted tensors in `phase` ("training" or "rollout");
    `activations` is the training peak's (the model being trained)."""
    tp, pp, colocated = cfg.parallel.tp, cfg.parallel.pp, cfg.rollout.engine == "sglang"
    groups = sum(size > 1 for size in (world_size, tp, pp, dp)) + (colocated and cfg.rollout.sglang_tp > 1)
    parts = {"CUDA context, trainer": CUDA_CONTEXT_BYTES}
    if colocated:
        parts["CUDA context, engine"] = CUDA_CONTEXT_BYTES
    parts[f"NCCL buffers ({groups} communicators)"] = groups * NCCL_COMMUNICATOR_BYTES
    if phase == "training":
        parts[f"allocator cache ({FRAGMENTATION_FRACTION:g} x activations)"] = int(FRAGMENTATION_FRACTION * activations)
    else:
        parts[ROLLOUT_CACHE_ITEM] = ROLLOUT_CACHE_BYTES
        if colocated:
            parts[SGLANG_RUNTIME_ITEM] = SGLANG_RUNTIME_BYTES
    return parts


def checkpoint_bytes(actor_params: int, critic_params: int, *, dtype_bytes: int) -> int:
    """One saved checkpoint, all ranks together: every parameter once in the model's dtype, plus
    Adam's state (fp32 master copy with bf16 parameters, exp_avg, exp_avg_sq); no gradients."""
    per_param = dtype_bytes + (12 if dtype_bytes < 4 else 8)
    return (actor_params + critic_params) * per_param


def layer_activation_bytes(hf_cfg: dict, *, tokens: int, tp: int, dtype_bytes: int,
                           sequence_parallel: bool = False) -> int:
    """Activations one transformer layer keeps for its backward pass, nothing recomputed, for
    `tokens` tokens on one TP rank (flash/fused attention: no T x T scores):
      4h          [T, h] tensors replicated over TP: input_layernorm's input, linear_qkv's input,
                  the residual entering pre_mlp_layernorm, linear_fc1's input; with sequence
                  parallelism each rank keeps its T/TP slice of them: 4h/TP
      (a+2g)d/TP  q, k, v (attention backward)
      ad/TP       attention output (kept by flash attention; also linear_proj's input)
      3f/TP       linear_fc1's output (gate and up) and the SwiGLU output (linear_fc2's input)
    Left out as small: softmax statistics, RMSNorm's per-token scale (dropout is 0: no masks)."""
    h, f = hf_cfg["hidden_size"], hf_cfg["intermediate_size"]
    a, g = hf_cfg["num_attention_heads"], query_groups(hf_cfg)
    d = head_dim(hf_cfg)
    per_token = (4 * h // tp if sequence_parallel else 4 * h) + ((a + 2 * g) * d + a * d + 3 * f) // tp
    return dtype_bytes * tokens * per_token


def logprob_buffer_bytes(tokens: int, vocab_shard: int, chunk_tokens: int) -> int:
    """vocab_parallel's float32 work buffer: [min(chunk_tokens, tokens), vocab_shard]."""
    return 4 * min(chunk_tokens, tokens) * vocab_shard


def activation_bytes(hf_cfg: dict, *, tokens: int, tp: int, pp: int, vpp: int | None, inflight_microbatches: int,
                     dtype_bytes: int, recompute: bool, logits_vocab: int, chunk_tokens: int,
                     sequence_parallel: bool = False) -> int:
    """Peak activations of one model on one rank. recompute (full, uniform, one layer per group):
    each layer keeps only its input [T, h] ([T/TP, h] with sequence parallelism), and the layer
    being back-propagated is recomputed in full. logits_vocab: the padded vocabulary on the last stage of the actor (0 elsewhere and for
    the critic, whose value head is [T, 1]): vocab-parallel logits [T, V/TP] and their gradient,
    for the one micro-batch the last stage holds, plus the log-prob kernel's one float32 work
    buffer [min(chunk_tokens, T), V/TP] (algorithms/vocab_parallel.py; trainer.logprob_chunk_tokens)."""
    # Layers with stored activations: in-flight (chunk) micro-batches x layers per (virtual) stage.
    n_layers = inflight_microbatches * (hf_cfg["num_hidden_layers"] // (pp * (vpp or 1)))
    full_layer = layer_activation_bytes(hf_cfg, tokens=tokens, tp=tp, dtype_bytes=dtype_bytes,
                                        sequence_parallel=sequence_parallel)
    if recompute:
        kept = tokens * hf_cfg["hidden_size"] // (tp if sequence_parallel else 1)
        layers = n_layers * dtype_bytes * kept + full_layer
    else:
        layers = n_layers * full_layer
    logits = 2 * dtype_bytes * tokens * (logits_vocab // tp) + logprob_buffer_bytes(tokens, logits_vocab // tp, chunk_tokens)
    return layers + logits


def kv_bytes_per_token(hf_cfg: dict, *, sglang_tp: int, dtype_bytes: int = 2) -> int:
    """SGLang's KV cache per token on one GPU: K and V of every layer, the rank's share of the KV
    heads (replicated when sglang_tp exceeds their number), bf16."""
    g, d = query_groups(hf_cfg), head_dim(hf_cfg)
    return 2 * hf_cfg["num_hidden_layers"] * max(1, g // sglang_tp) * d * dtype_bytes


__all__ = ["GIB", "ROLLOUT_CACHE_ITEM", "SGLANG_RUNTIME_ITEM", "activation_bytes", "checkpoint_bytes",
           "kv_bytes_per_token", "layer_activation_bytes", "logprob_buffer_bytes", "reserve_parts", "state_bytes"]
