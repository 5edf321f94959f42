"""How long one iteration takes, and what a run costs: pure functions of shapes, layout and a GPU's rates.

Nothing here ran on a GPU, and nothing is measured: every figure is a rate from a datasheet times
an efficiency stated below (docs/slurm.md, "Step time and cost", has the formulas, the
assumptions and the check against NeMo-RL's published step times). The phases are the trainer's
own (trainer/timing.py PHASES), so a prediction can be set beside a run's perf/<phase>_s:

  offload, onload   the trainer's state to host memory and back (trainer.offload_during_rollout):
                    bytes per GPU over the host link (PCIe; NVLink-C2C on GB200)
  rollout           SGLang's generation: prefill as compute; decode memory-bound, every step reads
                    the engine's weights and the KV cache of the sequences running, as many as the
                    KV cache holds, in waves; then the tail, the longest response decoding alone
                    to rollout.max_new_tokens
  score             forward passes over every token: the actor's log-probs, the critic's values
  critic_update     forward + backward (+ the recomputed forward) of every token, ppo_epochs times,
  actor_update      at an MFU, with the pipeline bubble; the gradient reduce and parameter gather of
                    each optimizer step over the data-parallel link (megatron's DDP here does not
                    overlap it: mcore/model.py, overlap_grad_reduce=False)
  sync              the actor's bf16 weights to the engines: TP all-gather over NVLink, the other
                    pipeline stages' tensors over the PP link, plus per-tensor and per-bucket costs
  checkpoint        one checkpoint's bytes to the file system, every trainer.save_every steps

Without a critic (algo.estimator=grpo) there is no score pass of the critic and no critic_update.
Pure Python: vapo-plan prints it (sizing/report.py), and vapo-train takes its step and save times
for the deadline before it has measured any (trainer/deadline.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# ---- the GPUs --------------------------------------------------------------------------------------
# Rates per GPU, one direction, bytes/s and FLOP/s. NVIDIA quotes tensor FLOP/s "with sparsity"
# (2:4) as the headline; the dense rate, used here, is half of it. Link rates are quoted
# bidirectional; one direction is half.


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float  # dense BF16 tensor-core peak
    hbm_bytes_s: float  # memory bandwidth
    nvlink_bytes_s: float  # NVLink, per GPU, one direction
    network_bytes_s: float  # the inter-node fabric, per GPU, one direction
    host_bytes_s: float  # host <-> device, one direction (PCIe; NVLink-C2C on GB200)
    memory_gib: float  # vapo-plan's default --gpu-memory-gib with --gpu
    # GPUs one NVLink domain spans; None: the node (--gpus-per-node). GB200 NVL72: a rack of 72.
    nvlink_domain: int | None = None


GPUS = {
    # H100 SXM5 80GB. NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): BF16 1,979 TFLOPS
    # with sparsity, 3.35 TB/s HBM3, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both bidirectional). Network:
    # DGX H100 user guide, 8 x ConnectX-7 400 Gb/s (one per GPU) for the compute fabric.
    "h100": GPU("H100 SXM 80GB", 989e12, 3.35e12, 450e9, 50e9, 64e9, 80.0),
    # H200 SXM 141GB. NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 1,979 TFLOPS
    # with sparsity, 4.8 TB/s HBM3e, NVLink 900 GB/s, PCIe Gen5 128 GB/s. DGX H200: 8 x ConnectX-7
    # 400 Gb/s. Memory: 141 GB = 131.3 GiB (the datasheet's GB; --gpu-memory-gib gives the exact one).
    "h200": GPU("H200 SXM 141GB", 989e12, 4.8e12, 450e9, 50e9, 64e9, 131.3),
    # A100 SXM4 80GB. NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): BF16 312 TFLOPS
    # dense (624 with sparsity), 2,039 GB/s HBM2e, NVLink 600 GB/s, PCIe Gen4 64 GB/s. DGX A100 user
    # guide: 8 x ConnectX-6 200 Gb/s for the compute fabric.
    "a100": GPU("A100 SXM 80GB", 312e12, 2.039e12, 300e9, 25e9, 32e9, 80.0),
    # B200 (HGX/DGX B200). NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx): per
    # 8 GPUs FP16/BF16 36 PFLOPS with sparsity, 64 TB/s HBM3e and 1.44 TB of it, NVLink 5 at
    # 1.8 TB/s per GPU. DGX B200 datasheet: 8 x ConnectX-7 400 Gb/s, PCIe Gen5 hosts.
    # Memory: 180 GB = 167.6 GiB.
    "b200": GPU("B200 180GB", 2.25e15, 8.0e12, 900e9, 50e9, 64e9, 167.6),
    # GB200 NVL72. NVIDIA GB200 NVL72 specifications (nvidia.com/en-us/data-center/gb200-nvl72): per
    # 72 GPUs FP16/BF16 360 PFLOPS with sparsity, 576 TB/s and 13.4 TB HBM3e, NVLink 130 TB/s
    # (1.8 TB/s per GPU) across the whole rack; NVLink-C2C 900 GB/s bidirectional between one Grace
    # CPU and its two GPUs (225 GB/s per GPU one way). One ConnectX-7 400 Gb/s per GPU for the
    # fabric between racks. Memory: 186 GB = 173.2 GiB.
    "gb200": GPU("GB200 NVL72", 2.5e15, 8.0e12, 900e9, 50e9, 225e9, 173.2, nvlink_domain=72),
}

# ---- efficiencies: assumptions, not measurements ----------------------------------------------------
# MFU of the trained and scored models' matmuls, counting every FLOP the GPU runs (the recomputed
# forward included). Dense: the Llama 3 paper (arXiv 2407.21783, Table 4) reports 38-43% BF16 MFU
# on H100 for 405B pre-training under TP 8 and pipeline parallelism, Megatron-style; RL's
# micro-batches are sequences of a few thousand tokens like pre-training's, so 0.40.
MFU_DENSE = 0.40
# Mixture-of-experts: Megatron-Bridge's performance summary (docs/performance-summary.md, 25.11
# container, DGX-H100) gives Qwen3-30B-A3B pre-training 121 model TFLOP/s per GPU (FP8, EP 8):
# 12% of the H100's dense BF16 peak; small experts and the all-to-all keep MoE MFU low.
MFU_MOE = 0.12
# Decode: the achieved share of HBM bandwidth over a whole decode step (GEMV-like weight reads
# reach 70-80% alone; attention over ragged contexts, norms, rotary and sampling run beside them).
DECODE_HBM_EFFICIENCY = 0.6
# Decode GEMMs of a batch of B rows: far from peak at the batch sizes a KV cache allows.
DECODE_COMPUTE_EFFICIENCY = 0.5
# Host-side time per decode step that the GPU waits for (SGLang's scheduler, CUDA-graph launch).
DECODE_STEP_OVERHEAD_S = 1.5e-3
# One small all-reduce of an engine's TP group (two per layer per decode step), NVLink latency.
TP_ALLREDUCE_LATENCY_S = 8e-6
# Achieved share of a link's rate by NCCL collectives and of the host link by pinned copies.
LINK_EFFICIENCY = 0.8
# Micro-batches are padded to their longest member after a length sort (data/microbatch.py):
# about 5% padding on long-tailed responses.
PADDING = 1.05
# The weight sync's costs besides bytes (rollout/weight_sync.py, rollout/sglang_engine.py): one
# gather/broadcast header and SGLang's weight loader per HF tensor, one update_weights_from_tensor
# call (CUDA IPC handles, scheduler round trip) per bucket, and the engine resuming its weights'
# memory and flushing its cache once per sync.
SYNC_PER_TENSOR_S = 2e-3
SYNC_PER_BUCKET_S = 0.1
SYNC_FIXED_S = 1.0


# ---- a model's shapes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    """What the FLOPs and bytes need of an HF config (sizes as in config.json)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0
    expert_ffn: int = 0
    moe_layers: int = 0  # layers with routed experts; the others keep a dense MLP

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def attention_params(self) -> int:
        """q, k, v, o (+ q/k/v biases, + per-head q/k norms) and the layer's two RMSNorms."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return qkv + bias + self.heads * self.head_dim * self.hidden + norms + 2 * self.hidden

    def params(self, *, critic: bool = False) -> int:
        """Every parameter: the actor's LM head (unless tied), or the critic's value head [1, h] + bias."""
        dense_mlp = 3 * self.hidden * self.ffn
        moe_mlp = self.experts * 3 * self.hidden * self.expert_ffn + self.hidden * self.experts  # + router
        head = self.hidden + 1 if critic else (0 if self.tied else self.vocab * self.hidden)
        return (self.vocab * self.hidden + self.layers * self.attention_params() + self.dense_layers * dense_mlp
                + self.moe_layers * moe_mlp + self.hidden + head)

    def expert_params(self) -> int:
        """The routed experts' parameters (split over parallel.ep ranks)."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.expert_ffn

    def hf_tensors(self) -> int:
        """HF tensors of the actor, the weight sync's unit: per layer q, k, v, o, two norms (+ 3
        biases, + 2 q/k norms), gate, up, down per dense MLP or per expert (+ the router)."""
        per_layer = 6 + 3 * self.qkv_bias + 2 * self.qk_norm
        return (self.layers * per_layer + 3 * self.dense_layers + self.moe_layers * (3 * self.experts + 1)
                + 2 + (not self.tied))

    def kv_bytes_per_token(self, engine_tp: int) -> int:
        """SGLang's bf16 K and V of every layer, per GPU (KV heads replicated past their number),
        as sizing/memory.py kv_bytes_per_token."""
        return 2 * self.layers * max(1, self.kv_heads // engine_tp) * self.head_dim * 2


def shapes_from_hf(hf_cfg: dict) -> Shapes:
    """The shapes of a supported HF config (model_providers reads it as the trainer does)."""
    from model_providers import family_for
    from model_providers.family import tied_embeddings
    from model_providers.table import head_dim, query_groups

    t = family_for(hf_cfg).architecture(hf_cfg).transformer
    moe = {}
    if "num_moe_experts" in t:
        pattern = t["moe_layer_freq"]
        moe = dict(experts=t["num_moe_experts"], top_k=t["moe_router_topk"], expert_ffn=t["moe_ffn_hidden_size"],
                   moe_layers=sum(pattern) if isinstance(pattern, list) else hf_cfg["num_hidden_layers"])
    return Shapes(layers=hf_cfg["num_hidden_layers"], hidden=hf_cfg["hidden_size"], heads=hf_cfg["num_attention_heads"],
                  kv_heads=query_groups(hf_cfg), head_dim=head_dim(hf_cfg), ffn=hf_cfg["intermediate_size"],
                  vocab=hf_cfg["vocab_size"], tied=tied_embeddings(hf_cfg), qkv_bias=bool(t["add_qkv_bias"]),
                  qk_norm=bool(t["qk_layernorm"]), **moe)


def forward_flops_per_token(s: Shapes, *, context: float, lm_head: bool) -> float:
    """Matmul FLOPs of one token's forward pass: 2 per weight it meets (the k routed experts only
    in an MoE layer) + attention's QK^T and PV over `context` keys (4 a d per layer and key) +
    the LM head [h, V] (actor) or the value head [h, 1] (critic). Backward is 2x this."""
    linear = 2 * (s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden)  # q, k, v, o
    attention = 4 * s.heads * s.head_dim * context
    dense_mlp = 2 * 3 * s.hidden * s.ffn
    moe_mlp = 2 * 3 * s.hidden * s.expert_ffn * s.top_k + 2 * s.hidden * s.experts
    head = 2 * s.hidden * (s.vocab if lm_head else 1)
    return s.layers * (linear + attention) + s.dense_layers * dense_mlp + s.moe_layers * moe_mlp + head


# ---- one iteration's inputs --------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """Everything one estimate needs, as numbers (setup_from_config builds it from a run config)."""

    actor: Shapes
    critic: Shapes | None  # None: no critic (algo.estimator=grpo)
    world: int
    gpus_per_node: int
    tp: int
    pp: int
    vpp: int | None
    ep: int  # parallel.ep
    engine_tp: int  # rollout.sglang_tp
    kv_tokens: int  # KV-cache tokens per engine
    prompts: int  # rollout.prompts_per_step
    samples: int  # prompts x rollout.n_samples
    prompt_tokens: float  # mean prompt length
    response_tokens: float  # mean response length
    max_response_tokens: int  # rollout.max_new_tokens: the tail
    micro_batch_tokens: int
    mini_batches: int
    ppo_epochs: int
    recompute: bool
    distributed_optimizer: bool
    offload_bytes_per_gpu: int  # copied to the host and back per step (0: no offload)
    checkpoint_bytes: int
    save_every: int
    storage_bytes_s: float  # what the job can write to its file system, all nodes together
    bucket_bytes: int  # rollout.weight_sync_bucket_mb
    value_pretrain_steps: int = 0
    total_steps: int = 0
    evals: int = 0  # evaluations over the run
    eval_prompts: int = 0  # prompts of one evaluation: one greedy response each, then eval_samples sampled
    eval_samples: int = 0  # eval.n_samples
    # Forward passes of a reference policy at scoring (0 here: VAPO, GRPO and DAPO as configured
    # have no KL term; NeMo-RL's published GRPO runs have one, tests/unit/test_step_time.py).
    reference_forwards: int = 0

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def engines(self) -> int:
        return self.world // self.engine_tp

    @property
    def sequence_tokens(self) -> float:
        return self.prompt_tokens + self.response_tokens

    @property
    def tokens(self) -> float:
        """Prompt + response tokens of one step's samples."""
        return self.samples * self.sequence_tokens


@dataclass(frozen=True)
class Phase:
    seconds: float
    how: str  # one line: what the figure is made of


@dataclass(frozen=True)
class Estimate:
    gpu: GPU
    setup: Setup
    phases: dict  # name -> Phase, in the trainer's order; the RL iteration's
    pretrain_step_s: float  # a value-pretraining iteration: no actor update
    eval_s: float  # one evaluation

    @property
    def step_s(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """NeMo-RL's definition (docs/about/performance-summary.md): the step's prompt + response
        tokens / (step time x GPUs)."""
        return self.setup.tokens / (self.step_s * self.setup.world)

    def share(self, name: str) -> float:
        return self.phases[name].seconds / self.step_s

    @property
    def run_s(self) -> float:
        s = self.setup
        return s.value_pretrain_steps * self.pretrain_step_s + s.total_steps * self.step_s + s.evals * self.eval_s

    @property
    def run_gpu_hours(self) -> float:
        return self.run_s * self.setup.world / 3600


# ---- links --------------------------------------------------------------------------------------------


def on_nvlink(gpu: GPU, span: int, gpus_per_node: int) -> bool:
    """Whether a group of ranks `span` consecutive global ranks wide (megatron's order: TP fastest,
    then DP, then PP) stays within one NVLink domain."""
    return span <= (gpu.nvlink_domain or gpus_per_node)


def link_bytes_s(gpu: GPU, span: int, gpus_per_node: int) -> float:
    """What a collective over such a group achieves per GPU: NVLink inside the domain, else the network."""
    rate = gpu.nvlink_bytes_s if on_nvlink(gpu, span, gpus_per_node) else gpu.network_bytes_s
    return rate * LINK_EFFICIENCY


# ---- the phases ----------------------------------------------------------------------------------------


def decode_step_s(gpu: GPU, s: Shapes, *, engine_tp: int, batch: float, context: float) -> float:
    """One decode step of `batch` sequences holding `context` tokens each, on one engine (every GPU
    its 1/engine_tp share): reading the bf16 weights and the batch's KV cache from HBM, or the
    batch's matmuls if those take longer, plus the step's host overhead and its TP all-reduces.
    An MoE engine reads every expert once a batch is larger than E/k (any realistic one)."""
    weights = 2 * s.params() / engine_tp
    kv = batch * context * s.kv_bytes_per_token(engine_tp)
    memory = (weights + kv) / (gpu.hbm_bytes_s * DECODE_HBM_EFFICIENCY)
    compute = batch * forward_flops_per_token(s, context=context, lm_head=True) / engine_tp / (
        gpu.bf16_flops * DECODE_COMPUTE_EFFICIENCY)
    allreduce = 2 * s.layers * TP_ALLREDUCE_LATENCY_S if engine_tp > 1 else 0.0
    return max(memory, compute) + DECODE_STEP_OVERHEAD_S + allreduce


def mfu(s: Shapes) -> float:
    return MFU_MOE if s.moe else MFU_DENSE


@dataclass(frozen=True)
class Rollout:
    seconds: float
    concurrency: int  # sequences decoding at once per engine
    waves: float  # samples per engine / concurrency
    step_s: float  # one decode step at that concurrency
    tail_step_s: float  # one decode step of the longest response alone
    prefill_s: float


def rollout(gpu: GPU, s: Shapes, *, engine_tp: int, engines: int, samples: int, prompts: int, prompt_tokens: float,
            response_tokens: float, max_response_tokens: int, kv_tokens: int) -> Rollout:
    """One engine's share of the samples (the engines run in parallel):
      concurrency  min(samples per engine, KV tokens / (prompt + mean response)): SGLang admits a
                   sequence while the cache holds it, and a finished one frees its slot at once
      bulk         waves x mean-response decode steps, waves = samples per engine / concurrency,
                   each step at the mean context prompt + mean/2
      tail         the longest response (rollout.max_new_tokens) decodes alone after the bulk:
                   max_new_tokens - mean more steps at batch 1, weight-bound
      prefill      each prompt once (its samples share the prefix in SGLang's radix cache), as compute."""
    per_engine = math.ceil(samples / engines)
    concurrency = max(1, min(per_engine, int(kv_tokens // (prompt_tokens + response_tokens))))
    waves = per_engine / concurrency
    step = decode_step_s(gpu, s, engine_tp=engine_tp, batch=concurrency, context=prompt_tokens + response_tokens / 2)
    tail_context = prompt_tokens + (response_tokens + max_response_tokens) / 2
    tail_step = decode_step_s(gpu, s, engine_tp=engine_tp, batch=1, context=tail_context)
    prefill_flops = math.ceil(prompts / engines) * prompt_tokens * forward_flops_per_token(
        s, context=prompt_tokens / 2, lm_head=True)
    prefill = prefill_flops / (engine_tp * gpu.bf16_flops * mfu(s))
    seconds = waves * response_tokens * step + max(0.0, max_response_tokens - response_tokens) * tail_step + prefill
    return Rollout(seconds, concurrency, waves, step, tail_step, prefill)


def bubble(pp: int, vpp: int | None, micro_batches: int) -> float:
    """Megatron's 1F1B schedule over m micro-batches takes (m + (pp - 1) / vpp) micro-batch times
    instead of m (the interleaved schedule divides the warm-up and cool-down by vpp)."""
    return 1.0 + (pp - 1) / ((vpp or 1) * max(1, micro_batches))


def micro_batches_per_rank(tokens_per_rank: float, micro_batch_tokens: int) -> int:
    return max(1, math.ceil(tokens_per_rank * PADDING / micro_batch_tokens))


def model_passes_s(gpu: GPU, s: Shapes, *, setup: Setup, tokens: float, passes: float, lm_head: bool,
                   micro_batches: int) -> float:
    """`passes` forward-equivalents (backward = 2) over `tokens` tokens on every GPU at the MFU,
    padded, with the pipeline bubble of `micro_batches` per data-parallel rank and schedule call."""
    flops = passes * tokens * PADDING * forward_flops_per_token(s, context=setup.sequence_tokens / 2, lm_head=lm_head)
    return flops / (setup.world * gpu.bf16_flops * mfu(s)) * bubble(setup.pp, setup.vpp, micro_batches)


def gradient_sync_s(gpu: GPU, s: Shapes, *, setup: Setup, critic: bool) -> float:
    """One optimizer step's data-parallel traffic per GPU: the fp32 gradients reduce-scattered and
    the bf16 parameters all-gathered (distributed optimizer), or the fp32 gradients all-reduced,
    each (dp - 1) / dp of the rank's bytes, over the DP group's link (DP ranks are TP apart)."""
    if setup.dp == 1:
        return 0.0
    experts = s.expert_params()
    per_gpu = (s.params(critic=critic) - experts + experts / setup.ep) / (setup.tp * setup.pp)
    moved = (4 + 2 if setup.distributed_optimizer else 2 * 4) * per_gpu * (setup.dp - 1) / setup.dp
    return moved / link_bytes_s(gpu, setup.tp * setup.dp, setup.gpus_per_node)


def update_s(gpu: GPU, s: Shapes, *, setup: Setup, critic: bool) -> tuple[float, str]:
    """ppo_epochs x (forward + backward (+ recomputed forward)) over every token, split into
    mini_batches optimizer steps, each with its gradient sync."""
    passes = (3 + setup.recompute) * setup.ppo_epochs
    per_rank = setup.tokens / setup.mini_batches / setup.dp
    m = micro_batches_per_rank(per_rank, setup.micro_batch_tokens)
    compute = model_passes_s(gpu, s, setup=setup, tokens=setup.tokens, passes=passes, lm_head=not critic,
                             micro_batches=m)
    steps = setup.mini_batches * setup.ppo_epochs
    sync = steps * gradient_sync_s(gpu, s, setup=setup, critic=critic)
    recompute = " (recompute on)" if setup.recompute else ""
    how = (f"{passes:g} forward-equivalents{recompute} of {setup.tokens / 1e6:,.2f}M "
           f"tokens at MFU {mfu(s):.2f}, bubble x{bubble(setup.pp, setup.vpp, m):.3f} ({m} micro-batches); "
           f"{steps} gradient syncs {sync:.1f} s")
    return compute + sync, how


def score_s(gpu: GPU, setup: Setup) -> tuple[float, str]:
    """Forward-only over every token: the actor's log-probs (LM head), the critic's values, and a
    reference policy's log-probs where one is configured (none here)."""
    m = micro_batches_per_rank(setup.tokens / setup.dp, setup.micro_batch_tokens)
    actor_passes = 1 + setup.reference_forwards
    seconds = model_passes_s(gpu, setup.actor, setup=setup, tokens=setup.tokens, passes=actor_passes, lm_head=True,
                             micro_batches=m)
    parts = ["actor log-probs"] + ["reference log-probs"] * setup.reference_forwards
    if setup.critic is not None:
        seconds += model_passes_s(gpu, setup.critic, setup=setup, tokens=setup.tokens, passes=1, lm_head=False,
                                  micro_batches=m)
        parts.append("critic values")
    return seconds, f"{' + '.join(parts)}: forward over {setup.tokens / 1e6:,.2f}M tokens at MFU {mfu(setup.actor):.2f}"


def sync_s(gpu: GPU, setup: Setup) -> tuple[float, str]:
    """The actor's bf16 HF tensors into every engine (docs/weight_sync.md): each stage's TP shards
    all-gathered over its TP group, (tp - 1) / tp of the model per GPU; with PP > 1 each stage's
    tensors broadcast in turn over the PP group (ranks tp x dp apart), the whole model's bytes; and
    the per-tensor, per-bucket and per-sync costs."""
    s = setup.actor
    model = 2 * s.params()
    gather = model * (setup.tp - 1) / setup.tp / link_bytes_s(gpu, setup.tp, setup.gpus_per_node)
    pp_span = setup.tp * setup.dp * setup.pp
    broadcast = model / link_bytes_s(gpu, pp_span, setup.gpus_per_node) if setup.pp > 1 else 0.0
    buckets = math.ceil(model / setup.bucket_bytes)
    fixed = s.hf_tensors() * SYNC_PER_TENSOR_S + buckets * SYNC_PER_BUCKET_S + SYNC_FIXED_S
    where = "NVLink" if on_nvlink(gpu, pp_span, setup.gpus_per_node) else "the network"
    how = (f"{model / 1e9:,.1f} GB of bf16 weights: TP gather {gather:.1f} s"
           + (f", PP broadcast over {where} {broadcast:.1f} s" if setup.pp > 1 else "")
           + f", {s.hf_tensors():,} tensors / {buckets} buckets {fixed:.1f} s")
    return gather + broadcast + fixed, how


def host_copy_s(gpu: GPU, nbytes: float) -> float:
    return nbytes / (gpu.host_bytes_s * LINK_EFFICIENCY)


def checkpoint_save_s(gpu: GPU, setup: Setup) -> float:
    """One checkpoint: each GPU's share copied to the host, and all of it written to the file
    system, whichever takes longer."""
    return max(host_copy_s(gpu, setup.checkpoint_bytes / setup.world), setup.checkpoint_bytes / setup.storage_bytes_s)


def estimate(gpu: GPU, setup: Setup) -> Estimate:
    """The phases of one RL iteration, a value-pretraining iteration and an evaluation."""
    ro = rollout(gpu, setup.actor, engine_tp=setup.engine_tp, engines=setup.engines, samples=setup.samples,
                 prompts=setup.prompts, prompt_tokens=setup.prompt_tokens, response_tokens=setup.response_tokens,
                 max_response_tokens=setup.max_response_tokens, kv_tokens=setup.kv_tokens)
    move = host_copy_s(gpu, setup.offload_bytes_per_gpu)
    host = (f"{setup.offload_bytes_per_gpu / 2**30:,.1f} GiB per GPU over the host link at "
            f"{gpu.host_bytes_s * LINK_EFFICIENCY / 1e9:.0f} GB/s")
    phases = {}
    if setup.offload_bytes_per_gpu:
        phases["offload"] = Phase(move, host + ", to pinned memory")
    per_engine = math.ceil(setup.samples / setup.engines)
    phases["rollout"] = Phase(ro.seconds, (
        f"{setup.engines} engine(s) of TP {setup.engine_tp}, {per_engine:,} samples each, {ro.concurrency:,} at once "
        f"(KV cache {setup.kv_tokens:,} tokens): {ro.waves:.2f} waves x {setup.response_tokens:,.0f} steps of "
        f"{ro.step_s * 1e3:.1f} ms + tail {max(0, setup.max_response_tokens - setup.response_tokens):,.0f} steps of "
        f"{ro.tail_step_s * 1e3:.1f} ms; prefill {ro.prefill_s:.1f} s"))
    if setup.offload_bytes_per_gpu:
        phases["onload"] = Phase(move, host + ", back")
    phases["score"] = Phase(*score_s(gpu, setup))
    if setup.critic is not None:
        phases["critic_update"] = Phase(*update_s(gpu, setup.critic, setup=setup, critic=True))
    phases["actor_update"] = Phase(*update_s(gpu, setup.actor, setup=setup, critic=False))
    phases["sync"] = Phase(*sync_s(gpu, setup))
    save = checkpoint_save_s(gpu, setup)
    phases["checkpoint"] = Phase(save / setup.save_every, (
        f"{setup.checkpoint_bytes / 1e9:,.1f} GB at {setup.storage_bytes_s / 1e9:g} GB/s = {save:,.0f} s, "
        f"every {setup.save_every} steps"))
    pretrain = sum(p.seconds for name, p in phases.items() if name != "actor_update")
    return Estimate(gpu, setup, phases, pretrain, evaluation_s(gpu, setup) + 2 * move if setup.evals else 0.0)


def evaluation_s(gpu: GPU, setup: Setup) -> float:
    """One evaluation (trainer.log_eval): two generations, a greedy response per eval prompt, then
    eval.n_samples sampled ones, each with its own tail; the state offloaded around both."""
    def generate(per_prompt: int) -> float:
        return rollout(gpu, setup.actor, engine_tp=setup.engine_tp, engines=setup.engines,
                       samples=setup.eval_prompts * per_prompt, prompts=setup.eval_prompts,
                       prompt_tokens=setup.prompt_tokens, response_tokens=setup.response_tokens,
                       max_response_tokens=setup.max_response_tokens, kv_tokens=setup.kv_tokens).seconds
    return generate(1) + generate(setup.eval_samples)


# ---- from a run config ----------------------------------------------------------------------------------

DEFAULT_PROMPT_TOKENS = 200  # a math prompt with its instruction and chat template, tokens


def default_response_tokens(max_new_tokens: int) -> int:
    """A quarter of rollout.max_new_tokens (5,120 of the 32B configs' 20,480): responses grow
    during RL; rerun with the run's measured mean (response_length/mean) once it is known."""
    return max(1, max_new_tokens // 4)


def default_prompt_tokens(max_prompt_tokens: int) -> int:
    return min(DEFAULT_PROMPT_TOKENS, max_prompt_tokens)


def setup_from_config(cfg, actor_hf: dict, critic_hf: dict | None, *, world: int, gpus_per_node: int, gpu: GPU,
                      gpu_memory_gib: float | None = None, response_tokens: float | None = None,
                      prompt_tokens: float | None = None, kv_tokens: int | None = None,
                      offload_bytes_per_gpu: int | None = None, checkpoint_bytes: int | None = None,
                      storage_bytes_s: float = 1e9, eval_prompts: int | None = None) -> Setup:
    """A Setup from a run config (vapo_megatron/config Config) and the models' HF configs. vapo-plan
    passes its own kv_tokens, offload and checkpoint bytes (megatron's exact parameter counts);
    left None they are counted here from the shapes, by the same formulas (sizing/memory.py)."""
    from vapo_megatron.sizing.memory import GIB, checkpoint_bytes as ckpt_bytes, state_bytes

    p, r, t, a = cfg.parallel, cfg.rollout, cfg.trainer, cfg.algo
    actor = shapes_from_hf(actor_hf)
    critic = shapes_from_hf(critic_hf or actor_hf) if a.estimator == "gae" else None
    dp = world // (p.tp * p.pp)
    dtype_bytes = 2 if cfg.model.dtype == "bfloat16" else 4
    if kv_tokens is None:
        share = r.sglang_mem_fraction * (gpu_memory_gib or gpu.memory_gib) * GIB
        kv_tokens = max(0, int((share - 2 * actor.params() / r.sglang_tp) // actor.kv_bytes_per_token(r.sglang_tp)))
    models = [(actor.params(), cfg.actor_optim)] + ([(critic.params(critic=True), cfg.critic_optim)] if critic else [])
    if offload_bytes_per_gpu is None:  # parameters + optimizer state; the gradient buffers are freed, not copied
        offload_bytes_per_gpu = 0
        if t.offload_during_rollout:
            for n, optim in models:
                params, _, optimizer = state_bytes(n // (p.tp * p.pp), dtype_bytes=dtype_bytes, dp=dp,
                                                   distributed_optimizer=optim.distributed_optimizer)
                offload_bytes_per_gpu += params + optimizer
    if checkpoint_bytes is None:
        checkpoint_bytes = ckpt_bytes(sum(n for n, _ in models), dtype_bytes=dtype_bytes)
    e = cfg.eval
    evals = (2 + max(0, t.total_steps - 1) // e.every) if cfg.data.eval_files else 0
    eval_n = min(e.max_prompts, eval_prompts) if eval_prompts is not None else e.max_prompts
    return Setup(
        actor=actor, critic=critic, world=world, gpus_per_node=gpus_per_node, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep,
        engine_tp=r.sglang_tp, kv_tokens=kv_tokens, prompts=r.prompts_per_step,
        samples=r.prompts_per_step * r.n_samples,
        prompt_tokens=prompt_tokens if prompt_tokens is not None else default_prompt_tokens(cfg.data.max_prompt_tokens),
        response_tokens=response_tokens if response_tokens is not None else default_response_tokens(r.max_new_tokens),
        max_response_tokens=r.max_new_tokens, micro_batch_tokens=t.micro_batch_tokens, mini_batches=a.mini_batches,
        ppo_epochs=a.ppo_epochs, recompute=cfg.model.recompute_activations,
        distributed_optimizer=cfg.actor_optim.distributed_optimizer, offload_bytes_per_gpu=offload_bytes_per_gpu,
        checkpoint_bytes=checkpoint_bytes, save_every=t.save_every, storage_bytes_s=storage_bytes_s,
        bucket_bytes=r.weight_sync_bucket_mb << 20, value_pretrain_steps=a.value_pretrain_steps,
        total_steps=t.total_steps, evals=evals, eval_prompts=eval_n, eval_samples=e.n_samples)


def predicted_step_and_save(cfg, actor_hf: dict, critic_hf: dict | None, *, world: int, gpus_per_node: int,
                            device_name: str, gpu_memory_gib: float | None = None) -> tuple[float, float]:
    """(one RL iteration, one checkpoint save) in seconds for vapo-train's deadline before it has
    measured either (trainer/deadline.py StepClock): this config at its defaults for what a
    config does not say (mean response rollout.max_new_tokens / 4, 1 GB/s to the file system).
    (0, 0) where the model has no rates: an unknown GPU, or an engine other than colocated SGLang."""
    gpu = gpu_from_device_name(device_name)
    if gpu is None or cfg.rollout.engine != "sglang":
        return 0.0, 0.0
    setup = setup_from_config(cfg, actor_hf, critic_hf, world=world, gpus_per_node=gpus_per_node, gpu=gpu,
                              gpu_memory_gib=gpu_memory_gib)
    return estimate(gpu, setup).step_s, checkpoint_save_s(gpu, setup)


def without_critic_delta(gpu: GPU, setup: Setup) -> float:
    """What a critic adds to a step of `setup` (algo.estimator=grpo): the same setup with one, the
    actor's trunk as its model, minus this one. Its extra state in offload and checkpoints is left out."""
    with_critic = replace(setup, critic=setup.actor)
    return estimate(gpu, with_critic).step_s - estimate(gpu, setup).step_s


# ---- the options ----------------------------------------------------------------------------------------


def option_problems(*, gpu: str | None, response_tokens: float | None, prompt_tokens: float | None,
                    storage_gb_s: float, eval_prompts: int | None, max_new_tokens: int,
                    max_prompt_tokens: int) -> list[str]:
    """vapo-plan's time options against each other and the config: one message per bad value, naming it."""
    problems = []
    if gpu is not None and gpu not in GPUS:
        problems.append(f"--gpu={gpu} is not a GPU this model knows; known: {', '.join(GPUS)}")
    for option, value in (("--mean-response-tokens", response_tokens), ("--mean-prompt-tokens", prompt_tokens),
                          ("--storage-gb-per-s", storage_gb_s), ("--eval-prompts", eval_prompts)):
        if value is not None and not value > 0:  # also NaN
            problems.append(f"{option}={value:g} must be > 0")
    if response_tokens is not None and response_tokens > max_new_tokens:
        problems.append(f"--mean-response-tokens={response_tokens:g} is more than "
                        f"rollout.max_new_tokens={max_new_tokens}: a mean cannot exceed the longest response")
    if prompt_tokens is not None and prompt_tokens > max_prompt_tokens:
        problems.append(f"--mean-prompt-tokens={prompt_tokens:g} is more than "
                        f"data.max_prompt_tokens={max_prompt_tokens}")
    return problems


def gpu_from_device_name(name: str) -> GPU | None:
    """The GPU of torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3", "NVIDIA GB200", ...), None when
    this model has no rates for it."""
    upper = name.upper()
    for key in ("gb200", "b200", "h200", "h100", "a100"):  # GB200 before B200: the longer name first
        if key.upper() in upper:
            if key == "a100" and "40GB" in upper:
                return None  # the 40 GB part has less memory bandwidth
            return GPUS[key]
    return None


__all__ = ["GPU", "GPUS", "Estimate", "Phase", "Rollout", "Setup", "Shapes", "bubble", "checkpoint_save_s",
           "decode_step_s", "default_prompt_tokens", "default_response_tokens", "estimate", "evaluation_s",
           "forward_flops_per_token", "gpu_from_device_name", "option_problems", "predicted_step_and_save", "rollout",
           "setup_from_config", "shapes_from_hf", "without_critic_delta"]
