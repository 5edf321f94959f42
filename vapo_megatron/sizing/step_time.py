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
                    to rollout.max_new_tokens (with rollout.partial: partial_rollout, a shorter tail)
  score             forward passes over every token: the actor's log-probs, the critic's values
  critic_update     forward + backward (+ the recomputed forward) of every token, ppo_epochs times,
  actor_update      at an MFU, with the pipeline bubble; the gradient reduce and parameter gather of
                    each optimizer step over the data-parallel link (megatron's DDP here does not
                    overlap it: mcore/model.py, overlap_grad_reduce=False)
  sync              the actor's bf16 weights to the engines: TP all-gather over NVLink, the other
                    pipeline stages' tensors over the PP link, plus per-tensor and per-bucket costs
  checkpoint        one checkpoint's bytes to the file system, every trainer.save_every steps

Without a critic (algo.estimator=grpo) there is no score pass of the critic and no critic_update.
A critic at its own layout (critic.parallel: Setup.critic_layout) is timed at its own PP/VPP (its
bubble), its own DP (the step's rows dealt over its DP ranks: its micro-batches per rank) and its
own TP x PP shard of the gradient sync; its compute is its FLOPs over all GPUs at the same MFU
whatever its TP (a small model's lower efficiency at a high TP and TP traffic are not priced).
Pure Python: hardware.py has the GPUs' rates, flops.py the models' shapes, step_config.py builds
a Setup from a run config; vapo-plan prints the estimate (sizing/report.py), and vapo-train takes
its step and save times for the deadline before it has measured any (trainer/deadline.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vapo_megatron.sizing.flops import Shapes, forward_flops_per_token
from vapo_megatron.sizing.hardware import GPU, LINK_EFFICIENCY, host_copy_s, link_bytes_s, on_nvlink
from vapo_megatron.sizing.step_setup import Setup

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

# ---- one iteration's inputs: step_setup.py Setup (re-exported here) ----------------------------------


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
    rollout_sync_s: float = 0.0  # the rollout phase without partial rollout
    rollout_partial_s: float = 0.0  # and with it (rollout.partial's settings, on or off in the config)
    critic_forward_s: float = 0.0  # the critic's values, of the score phase (0: no critic)

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


def partial_rollout(gpu: GPU, s: Shapes, *, engine_tp: int, engines: int, samples: int, prompts: int,
                    prompt_tokens: float, response_tokens: float, max_response_tokens: int, kv_tokens: int,
                    spare_batches: int, max_staleness: int) -> Rollout:
    """The rollout phase with rollout.partial (rollout/partial.py), in the steady state where a step
    trains as many samples as it admits, prompts_per_step groups (so it is with spare_batches <=
    max_staleness, which the config checks require):
      bulk      the same decode work per trained sample as `rollout` (waves x mean steps), at the
                concurrency of (1 + spare_batches) x the samples per engine in flight, as far as the
                KV cache holds them: the spare groups keep the batch full
      tail      a response spans at most max_staleness + 1 steps and grows by a bulk's steps in each,
                so the step waits, alone, only for what the longest response has left after that:
                max(0, max_new_tokens - (max_staleness + 1) x bulk steps) steps at batch 1
      prefill   the new prompts, and the carried responses that had started once more (the weight
                sync drops their KV cache): those running when the step stopped, min(spare_batches x
                the samples per engine, the concurrency), each prompt + mean / 2 tokens."""
    per_engine = math.ceil(samples / engines)
    context = prompt_tokens + response_tokens
    concurrency = max(1, min((1 + spare_batches) * per_engine, int(kv_tokens // context)))
    waves = per_engine / concurrency
    step = decode_step_s(gpu, s, engine_tp=engine_tp, batch=concurrency, context=prompt_tokens + response_tokens / 2)
    tail_steps = max(0.0, max_response_tokens - (max_staleness + 1) * waves * response_tokens)
    tail_step = decode_step_s(gpu, s, engine_tp=engine_tp, batch=1,
                              context=prompt_tokens + (response_tokens + max_response_tokens) / 2)
    carried = prompt_tokens + response_tokens / 2
    flops = (math.ceil(prompts / engines) * prompt_tokens
             * forward_flops_per_token(s, context=prompt_tokens / 2, lm_head=True)
             + min(spare_batches * per_engine, concurrency) * carried
             * forward_flops_per_token(s, context=carried / 2, lm_head=True))
    prefill = flops / (engine_tp * gpu.bf16_flops * mfu(s))
    return Rollout(waves * response_tokens * step + tail_steps * tail_step + prefill, concurrency, waves, step,
                   tail_step, prefill)


def bubble(pp: int, vpp: int | None, micro_batches: int) -> float:
    """Megatron's 1F1B schedule over m micro-batches takes (m + (pp - 1) / vpp) micro-batch times
    instead of m (the interleaved schedule divides the warm-up and cool-down by vpp)."""
    return 1.0 + (pp - 1) / ((vpp or 1) * max(1, micro_batches))


def micro_batches_per_rank(tokens_per_rank: float, micro_batch_tokens: int) -> int:
    return max(1, math.ceil(tokens_per_rank * PADDING / micro_batch_tokens))


def model_passes_s(gpu: GPU, s: Shapes, *, setup: Setup, tokens: float, passes: float, lm_head: bool,
                   micro_batches: int, critic: bool = False) -> float:
    """`passes` forward-equivalents (backward = 2) over `tokens` tokens on every GPU at the MFU,
    padded, with the pipeline bubble of `micro_batches` per data-parallel rank and schedule call
    (the critic's own PP and VPP with critic.parallel)."""
    flops = passes * tokens * PADDING * forward_flops_per_token(s, context=setup.sequence_tokens / 2, lm_head=lm_head)
    _, pp, vpp, _, _ = setup.layout(critic)
    return flops / (setup.world * gpu.bf16_flops * mfu(s)) * bubble(pp, vpp, micro_batches)


def gradient_sync_s(gpu: GPU, s: Shapes, *, setup: Setup, critic: bool) -> float:
    """One optimizer step's data-parallel traffic per GPU: the fp32 gradients reduce-scattered and
    the bf16 parameters all-gathered (distributed optimizer), or the fp32 gradients all-reduced,
    each (dp - 1) / dp of the rank's bytes, over the DP group's link (DP ranks are TP apart); the
    critic's at its own layout with critic.parallel."""
    tp, pp, _, ep, dp = setup.layout(critic)
    if dp == 1:
        return 0.0
    experts = s.expert_params()
    per_gpu = (s.params(critic=critic) - experts + experts / ep) / (tp * pp)
    moved = (4 + 2 if setup.distributed_optimizer else 2 * 4) * per_gpu * (dp - 1) / dp
    return moved / link_bytes_s(gpu, tp * dp, setup.gpus_per_node, setup.world)


def update_s(gpu: GPU, s: Shapes, *, setup: Setup, critic: bool) -> tuple[float, str]:
    """ppo_epochs x (forward + backward (+ recomputed forward)) over every token, split into
    mini_batches optimizer steps, each with its gradient sync."""
    passes = (3 + setup.recompute) * setup.ppo_epochs
    tp, pp, vpp, _, dp = setup.layout(critic)
    per_rank = setup.tokens / setup.mini_batches / dp
    m = micro_batches_per_rank(per_rank, setup.micro_batch_tokens)
    compute = model_passes_s(gpu, s, setup=setup, tokens=setup.tokens, passes=passes, lm_head=not critic,
                             micro_batches=m, critic=critic)
    steps = setup.mini_batches * setup.ppo_epochs
    sync = steps * gradient_sync_s(gpu, s, setup=setup, critic=critic)
    recompute = " (recompute on)" if setup.recompute else ""
    how = (f"{passes:g} forward-equivalents{recompute} of {setup.tokens / 1e6:,.2f}M "
           f"tokens at MFU {mfu(s):.2f}, bubble x{bubble(pp, vpp, m):.3f} ({m} micro-batches); "
           f"{steps} gradient syncs {sync:.1f} s" + (own_layout_note(setup) if critic else ""))
    return compute + sync, how


def critic_layout_text(setup: Setup) -> str:
    """The critic's layout as the report names it: "TP=8 PP=1 DP=8" (VPP and EP where set)."""
    tp, pp, vpp, ep, dp = setup.layout(True)
    return f"TP={tp} PP={pp}" + (f" VPP={vpp}" if vpp else "") + (f" EP={ep}" if ep > 1 else "") + f" DP={dp}"


def own_layout_note(setup: Setup) -> str:
    """The critic's own layout, as a phase's how-line ends with it ("" at the actor's)."""
    return "" if setup.critic_layout is None else f"; at the critic's own layout {critic_layout_text(setup)}"


def critic_forward_s(gpu: GPU, setup: Setup) -> float:
    """The critic's values at scoring: one forward over every token, its rows dealt over its own DP
    ranks (0 without a critic)."""
    if setup.critic is None:
        return 0.0
    m = micro_batches_per_rank(setup.tokens / setup.layout(True)[4], setup.micro_batch_tokens)
    return model_passes_s(gpu, setup.critic, setup=setup, tokens=setup.tokens, passes=1, lm_head=False,
                          micro_batches=m, critic=True)


def score_s(gpu: GPU, setup: Setup) -> tuple[float, str]:
    """Forward-only over every token: the actor's log-probs (LM head), the critic's values, and a
    reference policy's log-probs where one is configured (none here)."""
    m = micro_batches_per_rank(setup.tokens / setup.dp, setup.micro_batch_tokens)
    actor_passes = 1 + setup.reference_forwards
    seconds = model_passes_s(gpu, setup.actor, setup=setup, tokens=setup.tokens, passes=actor_passes, lm_head=True,
                             micro_batches=m)
    parts = ["actor log-probs"] + ["reference log-probs"] * setup.reference_forwards
    if setup.critic is not None:
        seconds += critic_forward_s(gpu, setup)
        parts.append("critic values")
    own = (f"; critic values {critic_forward_s(gpu, setup):.1f} s{own_layout_note(setup)}"
           if setup.critic is not None and setup.critic_layout is not None else "")
    return seconds, (f"{' + '.join(parts)}: forward over {setup.tokens / 1e6:,.2f}M tokens at MFU "
                     f"{mfu(setup.actor):.2f}{own}")


def sync_s(gpu: GPU, setup: Setup) -> tuple[float, str]:
    """The actor's bf16 HF tensors into every engine (docs/weight_sync.md): each stage's TP shards
    all-gathered over its TP group, (tp - 1) / tp of the model per GPU; with PP > 1 each stage's
    tensors broadcast in turn over the PP group (ranks tp x dp apart), the whole model's bytes; and
    the per-tensor, per-bucket and per-sync costs."""
    s = setup.actor
    model = 2 * s.params()
    gather = model * (setup.tp - 1) / setup.tp / link_bytes_s(gpu, setup.tp, setup.gpus_per_node, setup.world)
    pp_span = setup.tp * setup.dp * setup.pp
    broadcast = model / link_bytes_s(gpu, pp_span, setup.gpus_per_node, setup.world) if setup.pp > 1 else 0.0
    buckets = math.ceil(model / setup.bucket_bytes)
    fixed = s.hf_tensors() * SYNC_PER_TENSOR_S + buckets * SYNC_PER_BUCKET_S + SYNC_FIXED_S
    where = "NVLink" if on_nvlink(gpu, pp_span, setup.gpus_per_node, setup.world) else "the network"
    how = (f"{model / 1e9:,.1f} GB of bf16 weights: TP gather {gather:.1f} s"
           + (f", PP broadcast over {where} {broadcast:.1f} s" if setup.pp > 1 else "")
           + f", {s.hf_tensors():,} tensors / {buckets} buckets {fixed:.1f} s")
    return gather + broadcast + fixed, how


def checkpoint_save_s(gpu: GPU, setup: Setup) -> float:
    """One checkpoint: each GPU's share copied to the host, and all of it written to the file
    system, whichever takes longer."""
    return max(host_copy_s(gpu, setup.checkpoint_bytes / setup.world), setup.checkpoint_bytes / setup.storage_bytes_s)


def estimate(gpu: GPU, setup: Setup) -> Estimate:
    """The phases of one RL iteration, a value-pretraining iteration and an evaluation."""
    shape = dict(engine_tp=setup.engine_tp, engines=setup.engines, samples=setup.samples, prompts=setup.prompts,
                 prompt_tokens=setup.prompt_tokens, response_tokens=setup.response_tokens,
                 max_response_tokens=setup.max_response_tokens, kv_tokens=setup.kv_tokens)
    sync_ro = rollout(gpu, setup.actor, **shape)
    partial_ro = partial_rollout(gpu, setup.actor, **shape, spare_batches=setup.spare_batches,
                                 max_staleness=setup.max_staleness)
    ro = partial_ro if setup.partial else sync_ro
    tail = (max(0.0, setup.max_response_tokens - (setup.max_staleness + 1) * ro.waves * setup.response_tokens)
            if setup.partial else max(0, setup.max_response_tokens - setup.response_tokens))
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
        f"{ro.step_s * 1e3:.1f} ms + tail {tail:,.0f} steps of {ro.tail_step_s * 1e3:.1f} ms; "
        f"prefill {ro.prefill_s:.1f} s"
        + (" (partial rollout)" if setup.partial else "")))
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
    return Estimate(gpu, setup, phases, pretrain, evaluation_s(gpu, setup) + 2 * move if setup.evals else 0.0,
                    rollout_sync_s=sync_ro.seconds, rollout_partial_s=partial_ro.seconds,
                    critic_forward_s=critic_forward_s(gpu, setup))


def evaluation_s(gpu: GPU, setup: Setup) -> float:
    """One evaluation (trainer.log_eval): two generations, a greedy response per eval prompt, then
    eval.n_samples sampled ones, each with its own tail; the state offloaded around both."""
    def generate(per_prompt: int) -> float:
        return rollout(gpu, setup.actor, engine_tp=setup.engine_tp, engines=setup.engines,
                       samples=setup.eval_prompts * per_prompt, prompts=setup.eval_prompts,
                       prompt_tokens=setup.prompt_tokens, response_tokens=setup.response_tokens,
                       max_response_tokens=setup.max_response_tokens, kv_tokens=setup.kv_tokens).seconds
    return generate(1) + generate(setup.eval_samples)


__all__ = ["Estimate", "Phase", "Rollout", "Setup", "bubble", "checkpoint_save_s", "critic_forward_s",
           "critic_layout_text", "decode_step_s", "estimate", "evaluation_s", "own_layout_note", "partial_rollout",
           "rollout"]
