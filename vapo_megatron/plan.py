"""vapo-plan: will a run fit on its GPUs? Per-GPU memory of actor, critic and the SGLang engine.

    vapo-plan --config configs/qwen2.5_32b_vapo.yaml --nodes 8 --gpus-per-node 8 [--gpu-memory-gib 80]
              [--reserve-gib G] [--preset qwen2.5-32b] [key=value overrides...]

Nothing is loaded and no GPU is used. For each DISTINCT rank position (tp_rank, pp_rank; DP
replicas are identical) megatron's parallel state is initialized inside this process with torch's
fake process group (parallel.init_fake), and the real actor and critic providers
(model_providers.build.build_chunks) build that rank's shard on the meta device: the parameter
counts are megatron's own, vocabulary padding and pipeline placement of embedding, LM head and
value head included. Bytes are then counted per rank (docs/slurm.md, "Sizing"):

  parameters   n * dtype bytes (model.dtype)
  gradients    n * 4: megatron DDP's main_grad buffers are float32 (grad_reduce_in_fp32)
  optimizer    Adam: n * 12 with bf16 params (fp32 master copy + 2 fp32 moments), n * 8 with fp32
               params (moments only); divided by DP with the distributed optimizer
  activations  of the model being trained, for one micro-batch of T = trainer.micro_batch_tokens
               tokens, times the micro-batches a pipeline stage holds at once (megatron's own schedule
               arithmetic, peak_inflight_microbatches; layer_activation_bytes, activation_bytes
               below); with and without full recomputation

The model config comes from model.hf_path/config.json when that file exists; otherwise --preset
NAME (model_providers.presets) must be given, and it is always said which one was used.

Two phases per GPU, both must fit in --gpu-memory-gib minus a reserve, itemised per phase by
reserve_parts (CUDA contexts of trainer and engine, NCCL buffers, the caching allocator, SGLang's
buffers outside its static share); --reserve-gib replaces it by one flat figure:
  training  actor + critic parameters, gradients and optimizer state (both stay on the GPU all the
            time: the trainer offloads nothing) + the activations of the one model being trained;
            the SGLang engine has released its weights, KV cache and CUDA graphs
            (rollout_collect: engine.release_memory() after each generation).
  rollout   the same resident trainer state + the engine's static share, sglang_mem_fraction x GPU
            memory: SGLang sizes its KV cache as that share minus its weights (actor parameters in
            bf16 / rollout.sglang_tp per GPU). Assumes one engine TP rank on every GPU.
Also printed: the size of one checkpoint (actor and critic: weights + fp32 master copy + Adam
moments, what run_state saves) and the disk the kept checkpoints need.
Exit status: 0 fits, 1 does not fit (each failing phase, rank and the amount over are printed),
2 invalid configuration or layout.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch

from vapo_megatron.config import Config, ConfigError, config_problems, load_config, problems_error

GIB = float(1 << 30)


# ---- shards on the meta device ------------------------------------------------------------------

@dataclass(frozen=True)
class ShardSize:
    """Parameter counts of one distinct rank position (all its virtual-pipeline chunks)."""

    tp_rank: int
    pp_rank: int
    actor_params: int  # every parameter on this rank (what its memory holds)
    critic_params: int
    # This rank's share of the model's distinct parameters: TP-sharded tensors count on every TP
    # rank, TP-replicated ones (norms, the critic's value head) on tp_rank 0 only. Summed over all
    # positions: the model's parameter count (with megatron's padded vocabulary).
    actor_unique: int
    critic_unique: int
    # Micro-batches (model-chunk micro-batches with VPP) whose activations this pipeline rank holds
    # at its peak: megatron's own warm-up count for the training schedule + the one in 1F1B.
    inflight_microbatches: int


def peak_inflight_microbatches(pp: int, vpp: int | None, *, num_microbatches: int = 1024) -> int:
    """For the rank megatron's parallel state is initialized as: how many (chunk) micro-batches its
    training schedule keeps activations for at once, from megatron's own schedule arithmetic
    (get_pp_rank_microbatches: 1F1B warms up pp - rank - 1 micro-batches, the interleaved schedule
    (pp - rank - 1) * 2 + (vpp - 1) * pp chunk micro-batches), + 1 for the micro-batch in 1F1B.
    `num_microbatches`: a mini-batch has many (it is split by token budget), so no cap applies."""
    if pp == 1:
        return 1
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    _, _, warmup, _ = get_pp_rank_microbatches(num_microbatches, vpp or 1, pp, forward_only=False)
    return warmup + 1


def global_rank(tp_rank: int, pp_rank: int, *, tp: int, dp: int) -> int:
    """Global rank of (tp_rank, pp_rank, dp_rank=0) in megatron's default order tp-cp-ep-dp-pp
    (TP fastest, PP slowest); init_fake's parallel state is checked against it."""
    return tp_rank + tp * dp * pp_rank


def shard_sizes(actor_hf: dict, critic_hf: dict, *, world_size: int, tp: int, pp: int, vpp: int | None,
                params_dtype: torch.dtype) -> list[ShardSize]:
    """Build actor and critic shards of every distinct (tp_rank, pp_rank) on the meta device."""
    from model_providers.build import build_chunks

    from vapo_megatron import parallel

    dp = world_size // (tp * pp)
    out = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            parallel.init_fake(world_size, global_rank(tp_rank, pp_rank, tp=tp, dp=dp), tp, pp, vpp)
            try:
                where = (parallel.tp_rank(), parallel.pp_rank(), parallel.dp_rank())
                if where != (tp_rank, pp_rank, 0):
                    raise RuntimeError(f"megatron placed rank {global_rank(tp_rank, pp_rank, tp=tp, dp=dp)} at "
                                       f"(tp, pp, dp)={where}, expected {(tp_rank, pp_rank, 0)}")
                inflight = peak_inflight_microbatches(pp, vpp)
                counts, unique = [], []
                for hf_cfg, critic in ((actor_hf, False), (critic_hf, True)):
                    with torch.device("meta"):
                        chunks = build_chunks(hf_cfg, params_dtype=params_dtype, critic=critic, on_gpu=False)
                    params = [p for c in chunks for p in c.parameters()]
                    counts.append(sum(p.numel() for p in params))
                    unique.append(sum(p.numel() for p in params
                                      if tp_rank == 0 or getattr(p, "tensor_model_parallel", False)))
                    del chunks, params
            finally:
                parallel.destroy()
            out.append(ShardSize(tp_rank, pp_rank, counts[0], counts[1], unique[0], unique[1], inflight))
    return out


# ---- bytes per rank (pure functions of the shapes) ----------------------------------------------

def state_bytes(n_params: int, *, dtype_bytes: int, dp: int, distributed_optimizer: bool) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) in bytes for `n_params` parameters on one rank."""
    params = n_params * dtype_bytes
    grads = n_params * 4  # DDP main_grad buffer, float32 (megatron_step.wrap_ddp: grad_reduce_in_fp32)
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
# rollout the cache is emptied (gpu_memory.free_cached_memory), leaving only blocks pinned by
# live small tensors.
FRAGMENTATION_FRACTION = 0.25
ROLLOUT_CACHE_BYTES = int(0.5 * GIB)
# SGLang's memory outside mem_fraction_static (its forward activations, CUDA graph buffers,
# sampling): its static share holds weights + KV cache only.
SGLANG_RUNTIME_BYTES = int(1.5 * GIB)


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
        parts["allocator cache (emptied at the switch)"] = ROLLOUT_CACHE_BYTES
        if colocated:
            parts["SGLang buffers outside its static share"] = SGLANG_RUNTIME_BYTES
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
    a, g = hf_cfg["num_attention_heads"], hf_cfg["num_key_value_heads"]
    d = hf_cfg["head_dim"] if "head_dim" in hf_cfg else h // a
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
    buffer [min(chunk_tokens, T), V/TP] (vocab_parallel.py; trainer.logprob_chunk_tokens)."""
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
    h, a, g = hf_cfg["hidden_size"], hf_cfg["num_attention_heads"], hf_cfg["num_key_value_heads"]
    d = hf_cfg["head_dim"] if "head_dim" in hf_cfg else h // a
    return 2 * hf_cfg["num_hidden_layers"] * max(1, g // sglang_tp) * d * dtype_bytes


# ---- the plan ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank position; parts maps a component name to bytes."""

    tp_rank: int
    pp_rank: int
    parts: dict
    training: int  # resident state + the larger of the two models' activations + reserve
    rollout: int  # resident state + the engine's share + reserve
    reserve: dict  # phase -> {item: bytes}


@dataclass(frozen=True)
class Plan:
    world_size: int
    gpu_bytes: int
    flat_reserve: int | None  # --reserve-gib, replacing the itemised reserve
    layout: tuple[int, int, int, int | None]  # tp, pp, dp, vpp
    shards: list[ShardSize]
    ranks: list[RankMemory]
    engine_weights: int  # per GPU
    engine_share: int  # per GPU: sglang_mem_fraction x GPU memory
    kv_cache: int  # per GPU
    kv_tokens: int  # per engine (= per GPU: every engine rank holds its share of every token)
    sequence_tokens: int
    checkpoint: int  # bytes of one checkpoint (all ranks)
    problems: list[str]


def _padded_vocab(hf_cfg: dict, tp: int) -> int:
    from model_providers.build import padded_vocab_size

    return padded_vocab_size(hf_cfg, tp)


def make_plan(cfg: Config, actor_hf: dict, critic_hf: dict, *, world_size: int, gpu_memory_gib: float,
              reserve_gib: float | None = None) -> Plan:
    """Size `cfg` for `world_size` GPUs; `problems` lists what does not fit (empty: it fits)."""
    tp, pp, vpp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp
    dp = world_size // (tp * pp)
    dtype_bytes = 2 if cfg.model.dtype == "bfloat16" else 4
    params_dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    shards = shard_sizes(actor_hf, critic_hf, world_size=world_size, tp=tp, pp=pp, vpp=vpp, params_dtype=params_dtype)
    gpu = int(gpu_memory_gib * GIB)
    flat = None if reserve_gib is None else int(reserve_gib * GIB)
    r = cfg.rollout
    colocated = r.engine == "sglang"  # embedded: a CPU/test engine; sglang_http: servers elsewhere
    engine_share = int(r.sglang_mem_fraction * gpu) if colocated else 0
    engine_weights = sum(s.actor_unique for s in shards) * 2 // r.sglang_tp if colocated else 0  # bf16 / engine TP
    kv_cache = engine_share - engine_weights
    kv_tokens = max(0, kv_cache) // kv_bytes_per_token(actor_hf, sglang_tp=r.sglang_tp)
    sequence = cfg.data.max_prompt_tokens + r.max_new_tokens
    T = cfg.trainer.micro_batch_tokens
    recompute = cfg.model.recompute_activations
    sp = cfg.parallel.sequence_parallel and tp > 1  # off at tp=1 (config.py)

    ranks = []
    for s in shards:
        parts: dict[str, int] = {}
        for name, hf_cfg, n, optim, is_critic in (("actor", actor_hf, s.actor_params, cfg.actor_optim, False),
                                                  ("critic", critic_hf, s.critic_params, cfg.critic_optim, True)):
            p, g, o = state_bytes(n, dtype_bytes=dtype_bytes, dp=dp, distributed_optimizer=optim.distributed_optimizer)
            last = s.pp_rank == pp - 1
            vocab = 0 if is_critic or not last else _padded_vocab(hf_cfg, tp)
            act = {rc: activation_bytes(hf_cfg, tokens=T, tp=tp, pp=pp, vpp=vpp, inflight_microbatches=s.inflight_microbatches,
                                        dtype_bytes=dtype_bytes, recompute=rc, logits_vocab=vocab, sequence_parallel=sp,
                                        chunk_tokens=cfg.trainer.logprob_chunk_tokens) for rc in (True, False)}
            parts.update({f"{name} count": n, f"{name} parameters": p, f"{name} gradients": g, f"{name} optimizer state": o,
                          f"{name} activations": act[recompute], f"{name} activations, recompute": act[True],
                          f"{name} activations, no recompute": act[False]})
        resident = sum(parts[f"{m} {k}"] for m in ("actor", "critic") for k in ("parameters", "gradients", "optimizer state"))
        act = max(parts["actor activations"], parts["critic activations"])
        reserve = {ph: {"--reserve-gib": flat} if flat is not None else
                   reserve_parts(cfg, world_size=world_size, dp=dp, activations=act, phase=ph) for ph in ("training", "rollout")}
        ranks.append(RankMemory(s.tp_rank, s.pp_rank, parts, resident + act + sum(reserve["training"].values()),
                                resident + engine_share + sum(reserve["rollout"].values()), reserve))

    problems = []
    for phase in ("training", "rollout"):
        worst = max(ranks, key=lambda m: getattr(m, phase))
        need = getattr(worst, phase)
        if need > gpu:
            problems.append(_overflow_message(phase, worst, need, gpu, sum(worst.reserve[phase].values()), engine_share, recompute))
    if colocated and kv_cache <= 0:
        problems.append(f"rollout: the SGLang engine's share rollout.sglang_mem_fraction={r.sglang_mem_fraction} x "
                        f"{gpu / GIB:.1f} GiB = {engine_share / GIB:.1f} GiB does not hold its weights "
                        f"({engine_weights / GIB:.1f} GiB per GPU at rollout.sglang_tp={r.sglang_tp}): no room for a KV "
                        f"cache (short by {-kv_cache / GIB:.1f} GiB); raise sglang_mem_fraction or sglang_tp")
    elif colocated and kv_tokens < sequence:
        problems.append(f"rollout: the SGLang KV cache holds {kv_tokens} tokens per engine, less than one full "
                        f"sequence of data.max_prompt_tokens + rollout.max_new_tokens = {sequence}; raise "
                        f"rollout.sglang_mem_fraction or rollout.sglang_tp")
    ckpt = checkpoint_bytes(sum(s.actor_unique for s in shards), sum(s.critic_unique for s in shards), dtype_bytes=dtype_bytes)
    return Plan(world_size, gpu, flat, (tp, pp, dp, vpp), shards, ranks, engine_weights, engine_share,
                kv_cache, kv_tokens, sequence, ckpt, problems)


def _overflow_message(phase: str, m: RankMemory, need: int, gpu: int, reserve: int, engine_share: int,
                      recompute: bool) -> str:
    resident_keys = [f"{a} {k}" for a in ("actor", "critic") for k in ("parameters", "gradients", "optimizer state")]
    items = {k: m.parts[k] for k in resident_keys}
    if phase == "training":
        model = "actor" if m.parts["actor activations"] >= m.parts["critic activations"] else "critic"
        items[f"{model} activations" + (" (full recompute)" if recompute else " (no recompute)")] = m.parts[f"{model} activations"]
    else:
        items["SGLang engine (rollout.sglang_mem_fraction x GPU)"] = engine_share
    items["reserve"] = reserve
    top = sorted(items.items(), key=lambda kv: -kv[1])[:3]
    hint = ""
    if phase == "training" and not recompute:
        hint = "; model.recompute_activations=true would cut activations"
    return (f"{phase} does not fit on rank tp={m.tp_rank} pp={m.pp_rank}: needs {need / GIB:.1f} GiB of "
            f"{gpu / GIB:.1f} GiB ({(need - gpu) / GIB:.1f} GiB over); largest parts: "
            + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in top) + hint)


# ---- output --------------------------------------------------------------------------------------

def _yes(flag: bool) -> str:
    return "on" if flag else "off"


def _g(x: int) -> str:
    return f"{x / GIB:7.2f}"


def format_plan(plan: Plan, cfg: Config, *, model_source: str, nodes: int, gpus_per_node: int) -> str:
    tp, pp, dp, vpp = plan.layout
    r = cfg.rollout
    lines = [
        f"vapo-plan: {nodes} node(s) x {gpus_per_node} GPUs = {plan.world_size} GPUs of {plan.gpu_bytes / GIB:.1f} GiB",
        f"model: {model_source}",
        f"layout: TP={tp} PP={pp} VPP={vpp or '-'} DP={dp}; params {cfg.model.dtype}; "
        f"distributed optimizer: actor {_yes(cfg.actor_optim.distributed_optimizer)}, critic {_yes(cfg.critic_optim.distributed_optimizer)}; "
        f"full recompute: {_yes(cfg.model.recompute_activations)}; "
        f"sequence parallel: {_yes(cfg.parallel.sequence_parallel and tp > 1)}; micro_batch_tokens={cfg.trainer.micro_batch_tokens}",
        f"shards built on the meta device: {len(plan.shards)} distinct (tp_rank, pp_rank) positions x 2 models;",
        f"model parameters (TP-replicated ones once): actor {sum(s.actor_unique for s in plan.shards):,}, "
        f"critic {sum(s.critic_unique for s in plan.shards):,} (megatron's padded vocabulary)",
        "",
    ]
    worst = max(plan.ranks, key=lambda m: max(m.training, m.rollout))
    lines.append(f"{'per GPU, GiB, worst rank (tp=' + str(worst.tp_rank) + ' pp=' + str(worst.pp_rank) + ')':<52}"
                 f"{'actor':>7}   {'critic':>7}")
    rows = [("parameters", "parameters"), ("gradients (fp32 main_grad)", "gradients"),
            (f"optimizer state (Adam{', / DP=' + str(dp) if cfg.actor_optim.distributed_optimizer else ''})", "optimizer state"),
            ("activations, full recompute", "activations, recompute"),
            ("activations, no recompute", "activations, no recompute")]
    for label, key in rows:
        lines.append(f"  {label:<50}{_g(worst.parts['actor ' + key])}   {_g(worst.parts['critic ' + key])}")
    lines.append(f"  {'(parameters on this rank, billions)':<50}{worst.parts['actor count'] / 1e9:7.3f}   "
                 f"{worst.parts['critic count'] / 1e9:7.3f}")
    lines.append("")
    lines.append(f"{'per pipeline stage, GiB, worst TP rank':<52}{'training':>8}  {'rollout':>8}")
    for pr in range(pp):
        stage = [m for m in plan.ranks if m.pp_rank == pr]
        tr, ro = max(m.training for m in stage), max(m.rollout for m in stage)
        same = len({(m.training, m.rollout) for m in stage}) == 1
        label = f"pp={pr} (tp ranks 0-{tp - 1}{' identical' if same else ' differ'})"
        lines.append(f"  {label:<50}{_g(tr):>8}  {_g(ro):>8}")
    if r.engine == "sglang":
        engine_line = (
            f"SGLang: {plan.world_size // r.sglang_tp} engine(s) of TP={r.sglang_tp}; share {r.sglang_mem_fraction} x GPU = "
            f"{plan.engine_share / GIB:.1f} GiB per GPU: weights {plan.engine_weights / GIB:.1f} GiB (bf16 actor / "
            f"{r.sglang_tp}), KV cache {max(plan.kv_cache, 0) / GIB:.1f} GiB = {plan.kv_tokens:,} tokens per engine "
            f"({plan.kv_tokens // plan.sequence_tokens} full sequences of {plan.sequence_tokens:,} tokens at once)")
    else:
        engine_line = f"rollout.engine={r.engine}: no SGLang engine on these GPUs, none sized (rollout = resident state)"
    from vapo_megatron.run_state import KEEP_CHECKPOINTS

    lines.append(f"  (each includes the reserve below; limit {plan.gpu_bytes / GIB:.1f} GiB)")
    lines.append("")
    lines.append(f"{'reserve per GPU, GiB, worst rank' + (' (--reserve-gib)' if plan.flat_reserve is not None else ''):<52}"
                 f"{'training':>8}  {'rollout':>8}")
    for item in dict.fromkeys([*worst.reserve["training"], *worst.reserve["rollout"]]):
        tr, ro = worst.reserve["training"].get(item), worst.reserve["rollout"].get(item)
        lines.append(f"  {item:<50}{_g(tr) if tr is not None else '':>8}  {_g(ro) if ro is not None else '':>8}")
    lines.append(f"  {'total':<50}{_g(sum(worst.reserve['training'].values())):>8}  {_g(sum(worst.reserve['rollout'].values())):>8}")
    ckpt = plan.checkpoint
    lines += [
        "",
        f"checkpoints: {ckpt / 1e9:,.1f} GB per save (actor + critic: {cfg.model.dtype} weights + Adam state, all ranks); "
        f"{KEEP_CHECKPOINTS} kept, the next written before the oldest goes: {(KEEP_CHECKPOINTS + 1) * ckpt / 1e12:,.2f} TB "
        f"of disk at peak in trainer.run_dir; every trainer.save_every={cfg.trainer.save_every} steps",
        engine_line,
        "assumptions: actor and critic parameters, gradients and optimizer state stay on every GPU in both phases "
        "(the trainer offloads nothing); during training the engine has released weights, KV cache and CUDA graphs; "
        "during rollout no activations are held (the trainer empties its allocator cache at each switch); one engine TP rank per GPU; flash attention.",
        "",
    ]
    if plan.problems:
        lines.append("DOES NOT FIT:")
        lines += [f"  - {p}" for p in plan.problems]
    else:
        tr = max(plan.ranks, key=lambda m: m.training)
        ro = max(plan.ranks, key=lambda m: m.rollout)
        lines.append(f"fits: training peak {tr.training / GIB:.1f} GiB (tp={tr.tp_rank} pp={tr.pp_rank}), "
                     f"rollout peak {ro.rollout / GIB:.1f} GiB, of {plan.gpu_bytes / GIB:.1f} GiB per GPU")
    return "\n".join(lines)


# ---- command line --------------------------------------------------------------------------------

def resolve_model_config(hf_path: str, preset: str | None, *, key: str) -> tuple[dict, str]:
    """(HF config dict, where it came from): --preset wins; else hf_path/config.json, which must exist."""
    import model_providers
    from model_providers.presets import PRESETS
    from model_providers.presets import preset as get_preset

    if preset is not None:
        hf_cfg = get_preset(preset)
        hf_cfg["_source"] = f"preset {preset}"
        return hf_cfg, f"preset {preset} (--preset; {key}={hf_path or '(empty)'} not read)"
    if hf_path and os.path.isfile(os.path.join(hf_path, "config.json")):
        hf_cfg = model_providers.load_hf_config(hf_path)
        return hf_cfg, hf_cfg["_source"]
    raise ConfigError(f"{key}={hf_path or '(empty)'} has no config.json: give the model's config with "
                      f"--preset NAME (known: {', '.join(PRESETS)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vapo-plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="run config (YAML)")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, required=True)
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (default 80)")
    ap.add_argument("--reserve-gib", type=float, default=None,
                    help="one flat figure kept free on every GPU instead of the itemised reserve (CUDA contexts, NCCL "
                         "buffers, allocator cache, SGLang's buffers; printed)")
    ap.add_argument("--preset", default=None,
                    help="model config by name (model_providers.presets), for planning without the model files; "
                         "otherwise model.hf_path/config.json is read")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. parallel.pp=2")
    args = ap.parse_args(argv)
    try:
        if args.nodes < 1 or args.gpus_per_node < 1:
            raise ConfigError(f"--nodes={args.nodes} and --gpus-per-node={args.gpus_per_node} must be >= 1")
        cfg = load_config(args.config, args.overrides, check=False)
        world = args.nodes * args.gpus_per_node
        actor_hf, source = resolve_model_config(cfg.model.hf_path, args.preset, key="model.hf_path")
        critic_hf = actor_hf
        if cfg.model.critic_hf_path and args.preset is None:
            critic_hf, critic_source = resolve_model_config(cfg.model.critic_hf_path, None, key="model.critic_hf_path")
            source += f"; critic: {critic_source}"
        problems = config_problems(cfg, check_paths=False)
        from vapo_megatron.preflight import layout_problems

        problems += layout_problems(cfg, world, actor_hf)
        r = cfg.rollout
        if r.engine == "sglang" and (world % r.sglang_tp or r.sglang_tp > args.gpus_per_node):
            problems.append(f"rollout.sglang_tp={r.sglang_tp} must divide the {world} GPUs and fit in one node of "
                            f"{args.gpus_per_node} GPUs (a colocated engine uses its node's GPUs)")
        if r.engine == "sglang" and actor_hf["num_attention_heads"] % r.sglang_tp:
            problems.append(f"rollout.sglang_tp={r.sglang_tp} does not divide num_attention_heads="
                            f"{actor_hf['num_attention_heads']} ({actor_hf['_source']})")
        if problems:
            raise problems_error(problems)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"vapo-plan: invalid configuration for {args.nodes} x {args.gpus_per_node} GPUs: {e}", file=sys.stderr)
        return 2
    plan = make_plan(cfg, actor_hf, critic_hf, world_size=world, gpu_memory_gib=args.gpu_memory_gib,
                     reserve_gib=args.reserve_gib)
    print(f"config: {args.config}" + (f" with {' '.join(args.overrides)}" if args.overrides else ""))
    print(format_plan(plan, cfg, model_source=source, nodes=args.nodes, gpus_per_node=args.gpus_per_node))
    return 1 if plan.problems else 0


if __name__ == "__main__":
    sys.exit(main())
