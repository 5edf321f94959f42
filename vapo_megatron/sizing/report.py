"""vapo-plan's report: the plan as the table a user reads before queueing a job."""

from __future__ import annotations

from vapo_megatron.config import Config
from vapo_megatron.config.engines import engine_key, engine_of, engine_settings, engine_tp
from vapo_megatron.sizing.memory import GIB, LOAD_GPU, LOAD_HOST, MOE_ITEMS, SAVE_GPU, SAVE_HOST
from vapo_megatron.sizing.plan import Plan


def _yes(flag: bool) -> str:
    return "on" if flag else "off"


def _g(x: int) -> str:
    return f"{x / GIB:7.2f}"


def _kv_resume_lines(plan: Plan, cfg: Config) -> list[str]:
    """The rollout phase of its worst rank, by name: what is left on the GPU when the owner resumes
    the KV cache, then what the engine adds; and the transients freed before, not counted."""
    m = max(plan.ranks, key=lambda x: x.rollout)
    runtime = m.rollout - sum(m.kv_resume.values()) - plan.engine_share
    lines = [f"{'rollout per GPU, GiB, worst rank (' + m.where() + ')':<52}"
             f"{'GiB':>8}",
             "  computed from shapes and the reserve estimates above, not measured on a GPU",
             "  left when the owner resumes the KV cache (every rank of its engine has emptied PyTorch's cache):"]
    lines += [f"    {k:<48}{_g(v):>8}" for k, v in m.kv_resume.items()]
    lines.append(f"  {'what remains':<50}{_g(sum(m.kv_resume.values())):>8}")
    if m.offloaded:
        lines.append("  off the GPU before the resume (trainer.offload_during_rollout; to pinned host memory, but the "
                     "gradient buffers: freed, zeroed on return), not counted:")
        lines += [f"    {k + (', freed' if 'gradient' in k else ', to host'):<48}{_g(v):>8}"
                  for k, v in m.offloaded.items()]
    if engine_of(cfg).colocated:
        label = engine_of(cfg).label
        lines.append(f"  {'+ ' + label + ' static share (weights + KV cache)':<50}{_g(plan.engine_share):>8}")
        lines.append(f"  {'+ ' + label + ' buffers outside its static share':<50}{_g(runtime):>8}")
    lines.append(f"  {'= rollout':<50}{_g(m.rollout):>8}")
    lines.append("  freed on every rank before the resume, not counted:")
    lines += [f"    {k:<68}{'(by the data)' if v is None else _g(v)}" for k, v in plan.freed_before_resume.items()]
    return lines


def _routes_lines(plan: Plan) -> list[str]:
    """Routing replay's host memory per rank (its GPU item is in the training reserve), at most."""
    if not plan.routes_host:
        return []
    lines = [f"routing replay (rollout.routing_replay): host memory per rank, at most (every sequence at full length), "
             f"{sum(plan.routes_host.values()) / GIB:.2f} GiB:"]
    return lines + [f"  {k:<78}{_g(v):>8}" for k, v in plan.routes_host.items()]


def _offload_lines(plan: Plan, cfg: Config, gpus_per_node: int) -> list[str]:
    """The colocated engine's KV cache with and without trainer.offload_during_rollout, at this config's
    rollout peak."""
    peak, fits = plan.kv_compare["peak"], not any(p.startswith("rollout") for p in plan.problems)
    on, off = plan.kv_compare["offloaded"], plan.kv_compare["resident"]
    key = engine_key(cfg, "mem_fraction")
    lines = [f"{engine_of(cfg).label} KV cache per GPU with and without trainer.offload_during_rollout (this config: "
             f"{_yes(plan.offload)}), computed from shapes and the estimates above, not measured, at "
             + (f"this config's rollout peak of {peak / GIB:.1f} GiB:" if fits else
                f"a rollout peak of the GPU's {peak / GIB:.1f} GiB (this config's does not fit):")]
    for label, c, this in (("offloaded", on, plan.offload), ("resident", off, not plan.offload)):
        lines.append(f"  trainer state {label + ':':<10} {key} {c['fraction']:.2f} = {c['share'] / GIB:5.1f} GiB, "
                     f"KV cache {max(c['kv_cache'], 0) / GIB:5.1f} GiB = {c['kv_tokens']:,} tokens per engine, "
                     f"{c['sequences']} full sequences of {plan.sequence_tokens:,} tokens at once"
                     + (f"  <- {key}" if this and c["configured"] else ""))
    ratio = on["kv_cache"] / off["kv_cache"] if off["kv_cache"] > 0 else float("inf")
    lines.append(f"  offload: {ratio:.2f}x the KV cache; frees {plan.state_per_gpu / GIB:.1f} GiB per GPU (worst "
                 f"rank), of which {plan.host_per_gpu / GIB:.1f} GiB in pinned host memory (the gradient buffers are "
                 f"dropped, not copied), up to {gpus_per_node * plan.host_per_gpu / GIB:.1f} GiB per node of "
                 f"{gpus_per_node} GPUs (checked against MemAvailable and the job's cgroup limit at start-up)")
    return lines


def _checkpoint_io_lines(plan: Plan) -> list[str]:
    """A save's and a load's memory per rank beyond its state (memory.checkpoint_parts), the worst rank's."""
    if not plan.ranks[0].checkpoint_io:
        return []
    w = {k: max(m.checkpoint_io[k] for m in plan.ranks) for k in (SAVE_HOST, SAVE_GPU, LOAD_HOST, LOAD_GPU)}
    return [f"  each save and resume per rank (worst rank; computed, the models one after the other): save: host "
            f"{w[SAVE_HOST] / GIB:.2f} GiB (the staged copy of what it writes: DP rank 0's weights + its own Adam "
            f"share), GPU +{w[SAVE_GPU] / GIB:.2f} GiB; load: host {w[LOAD_HOST] / GIB:.2f} GiB (one stored tensor at "
            f"a time; it reads its own share), GPU +{w[LOAD_GPU] / GIB:.2f} GiB over its state (megatron's SwiGLU "
            "merge of linear_fc1, or the fused Adam setting its moments anew)"]


NO_CRITIC = "none (algo.estimator=grpo)"


def _no_critic_lines(plan: Plan, cfg: Config) -> list[str]:
    """algo.estimator=grpo: what having no critic frees, against the same config with a critic
    (Plan.with_critic), the KV cache at this plan's rollout peak with the trainer's state offloaded
    and resident."""
    other = plan.with_critic
    state = other.state_per_gpu - plan.state_per_gpu
    train = (max(m.training for m in other.ranks) - max(m.training for m in plan.ranks)) / GIB
    lines = [f"no critic (algo.estimator=grpo) against the same config with one (algo.estimator=gae, "
             "critic_optim.distributed_optimizer as the actor's; computed): "
             f"{state / GIB:.1f} GiB less trainer state per GPU (worst rank), training peak {train:.1f} GiB lower, "
             f"checkpoints {(other.checkpoint - plan.checkpoint) / 1e9:,.1f} GB smaller"]
    if not plan.kv_compare:
        return lines
    lines.append(f"  {engine_of(cfg).label} KV cache per GPU at this config's rollout peak of "
                 f"{plan.kv_compare['peak'] / GIB:.1f} GiB, without / with a critic:")
    for way, this in (("offloaded", plan.offload), ("resident", not plan.offload)):
        a, b = plan.kv_compare[way], other.kv_compare[way]
        more = (max(a["kv_cache"], 0) - max(b["kv_cache"], 0)) / GIB
        lines.append(f"  trainer state {way + ':':<10} {max(a['kv_cache'], 0) / GIB:5.1f} GiB = {a['sequences']} full "
                     f"sequences / {max(b['kv_cache'], 0) / GIB:5.1f} GiB = {b['sequences']}: {more:+.1f} GiB, "
                     f"{a['sequences'] - b['sequences']:+d} sequences per engine"
                     + ("  <- this config" if this else ""))
    if plan.offload:
        lines.append("  (with trainer.offload_during_rollout the critic's state would be in host memory during "
                     "rollout: no critic leaves the KV cache as it is and saves that host memory; resident, the KV "
                     "cache gains it)")
    return lines


def _critic_layout_lines(plan: Plan, cfg: Config) -> list[str]:
    """How the shards were built, and with critic.parallel the critic's own layout on the same GPUs."""
    models = plan.models
    if plan.critic_layout is None:
        return [f"shards built on the meta device: {len(plan.shards)} distinct (tp_rank, pp_rank) positions x "
                f"{len(models)} model{'s' * (len(models) > 1)} ({' and '.join(models)});"]
    tp, pp, dp, vpp, ep = plan.critic_layout
    c = cfg.critic.parallel
    ep_text = f" EP={ep}" if ep > 1 else ""
    return [f"critic layout (critic.parallel): TP={tp} PP={pp} VPP={vpp or '-'} DP={dp}{ep_text}; sequence parallel: "
            f"{_yes(c.sequence_parallel and tp > 1)}; on the same GPUs as the actor, each step's rows dealt over its "
            f"{dp} DP ranks",
            f"shards built on the meta device: {len(plan.shards)} actor and {len(plan.critic_shards)} critic "
            f"(tp_rank, pp_rank) positions, each at its own layout; {len(plan.ranks)} distinct pairs on the GPUs "
            "(per GPU: both models' state, the larger one's activations);"]


def ep_group_nodes(*, tp: int, pp: int, dp: int, ep: int, gpus_per_node: int) -> int:
    """The most nodes one expert-parallel group spans. Megatron orders ranks tp-cp-ep-dp-pp (TP
    fastest): an EP group is the ranks r + tp*k, k < ep, of one TP rank r, expert-DP rank and
    pipeline stage, so it stays in a node only when tp * ep fits in one."""
    return max(len({(stage * tp * dp + r + tp * (k + ep * e)) // gpus_per_node for k in range(ep)})
               for stage in range(pp) for e in range(dp // ep) for r in range(tp))


def format_plan(plan: Plan, cfg: Config, *, model_source: str, nodes: int, gpus_per_node: int) -> str:
    tp, pp, dp, vpp = plan.layout
    r = cfg.rollout
    models, critic = plan.models, "critic" in plan.models
    optim = {"actor": cfg.actor_optim, "critic": cfg.critic_optim}
    moe = any(s.actor_expert for s in plan.shards) or any(s.critic_expert for s in plan.model_shards("critic"))
    span = ep_group_nodes(tp=tp, pp=pp, dp=dp, ep=plan.ep, gpus_per_node=gpus_per_node)
    where = "each EP group within one node" if span == 1 else \
        f"an EP group spans {span} nodes: every MoE all-to-all crosses the network"
    ep = f" EP={plan.ep} (expert-DP={dp // plan.ep}; {where})" if moe or plan.ep > 1 else ""
    counted = "TP-replicated ones once" + (", the experts of every EP rank" if moe else "")
    lines = [
        f"vapo-plan: {nodes} node(s) x {gpus_per_node} GPUs = {plan.world_size} GPUs of {plan.gpu_bytes / GIB:.1f} GiB",
        f"model: {model_source}",
        f"layout: TP={tp} PP={pp} VPP={vpp or '-'} DP={dp}{ep}; params {cfg.model.dtype}; "
        "distributed optimizer: " + ", ".join(f"{m} {_yes(optim[m].distributed_optimizer)}" for m in models)
        + ("" if critic else f", critic {NO_CRITIC}") + "; "
        f"full recompute: {_yes(cfg.model.recompute_activations)}; "
        f"sequence parallel: {_yes(cfg.parallel.sequence_parallel and tp > 1)}; "
        f"micro_batch_tokens={cfg.trainer.micro_batch_tokens}, "
        f"logprob_chunk_tokens={cfg.trainer.logprob_chunk_tokens} (actor activations include its float32 buffer)",
        *_critic_layout_lines(plan, cfg),
        f"model parameters ({counted}): "
        + ", ".join(f"{m} {sum(getattr(s, f'{m}_unique') for s in plan.model_shards(m)):,}" for m in models)
        + ("" if critic else f", critic {NO_CRITIC}") + " (megatron's padded vocabulary)",
        "",
    ]
    worst = max(plan.ranks, key=lambda m: max(m.training, m.rollout))
    lines.append(f"{'per GPU, GiB, worst rank (' + worst.where() + ')':<52}"
                 + "   ".join(f"{m:>7}" for m in models))

    def cells(key: str, fmt=_g) -> str:
        return "   ".join(fmt(worst.parts[f"{m} {key}"]) for m in models)

    def billions(n: int) -> str:
        return f"{n / 1e9:7.3f}"

    sharded = ""
    if cfg.actor_optim.distributed_optimizer:
        sharded = f", / DP={dp}" + (f", experts / {dp // plan.ep}" if moe else "")
    if plan.critic_layout is not None:  # the critic's DP is its own
        c_dp, c_ep = plan.critic_layout[2], plan.critic_layout[4]
        sharded = (f", / DP={dp} actor" if cfg.actor_optim.distributed_optimizer else ", actor unsharded") + (
            f", {c_dp} critic" + (f", its experts / {c_dp // c_ep}" if c_ep > 1 else "")
            if cfg.critic_optim.distributed_optimizer else ", critic unsharded")
    rows = [("parameters", "parameters"), ("gradients (fp32 main_grad)", "gradients"),
            (f"optimizer state (Adam{sharded})", "optimizer state"),
            ("activations, full recompute", "activations, recompute"),
            ("activations, no recompute", "activations, no recompute")]
    for label, key in rows:
        lines.append(f"  {label:<50}{cells(key)}")
        if moe and key.startswith("activations"):  # the MoE layers' items, included in the line above
            lines += [f"    {item:<48}{cells(f'{key}: {item}')}" for item in MOE_ITEMS]
    lines.append(f"  {'(parameters on this rank, billions)':<50}{cells('count', billions)}")
    if moe:
        lines.append(f"  {'(of which routed experts: E/EP per MoE layer)':<50}{cells('expert count', billions)}")
    if not critic:
        lines.append(f"  critic: {NO_CRITIC}: no parameters, gradients, optimizer state or activations; not built")
    lines.append("")
    lines.append(f"{'per pipeline stage, GiB, worst TP rank':<52}{'training':>8}  {'rollout':>8}")
    for pr in range(pp):
        stage = [m for m in plan.ranks if m.pp_rank == pr]
        tr, ro = max(m.training for m in stage), max(m.rollout for m in stage)
        same = len({(m.training, m.rollout) for m in stage}) == 1
        label = f"pp={pr} (tp ranks 0-{tp - 1}{' identical' if same else ' differ'})"
        lines.append(f"  {label:<50}{_g(tr):>8}  {_g(ro):>8}")
    engine, engine_tp_ = engine_of(cfg), engine_tp(cfg)
    if engine.colocated:
        engine_line = (
            f"{engine.label}: {plan.world_size // engine_tp_} engine(s) of TP={engine_tp_}; share "
            f"{engine_settings(cfg).mem_fraction} x GPU = "
            f"{plan.engine_share / GIB:.1f} GiB per GPU: weights {plan.engine_weights / GIB:.1f} GiB (bf16 actor / "
            f"{engine_tp_}), KV cache {max(plan.kv_cache, 0) / GIB:.1f} GiB = {plan.kv_tokens:,} tokens per engine "
            f"({plan.kv_tokens // plan.sequence_tokens} full sequences of {plan.sequence_tokens:,} tokens at once)")
    else:
        engine_line = (f"rollout.engine={r.engine}: no colocated engine on these GPUs, none sized "
                       "(rollout = resident state)")
    offload_lines = _offload_lines(plan, cfg, gpus_per_node) if engine.colocated else []
    from vapo_megatron.checkpoint.manager import KEEP_CHECKPOINTS

    lines.append(f"  (each includes the reserve below; limit {plan.gpu_bytes / GIB:.1f} GiB)")
    lines.append("")
    lines.append(
        f"{'reserve per GPU, GiB, worst rank' + (' (--reserve-gib)' if plan.flat_reserve is not None else ''):<52}"
        f"{'training':>8}  {'rollout':>8}")
    for item in dict.fromkeys([*worst.reserve["training"], *worst.reserve["rollout"]]):
        tr, ro = worst.reserve["training"].get(item), worst.reserve["rollout"].get(item)
        lines.append(f"  {item:<50}{_g(tr) if tr is not None else '':>8}  {_g(ro) if ro is not None else '':>8}")
    lines.append(f"  {'total':<50}{_g(sum(worst.reserve['training'].values())):>8}  "
                 f"{_g(sum(worst.reserve['rollout'].values())):>8}")
    lines += ["", *_kv_resume_lines(plan, cfg)]
    ckpt = plan.checkpoint
    lines += [
        "",
        f"checkpoints: {ckpt / 1e9:,.1f} GB per save ({' + '.join(models)}: {cfg.model.dtype} weights + Adam state, "
        f"all ranks); {KEEP_CHECKPOINTS} kept, the next written before the oldest goes: "
        f"{(KEEP_CHECKPOINTS + 1) * ckpt / 1e12:,.2f} TB of disk at peak in trainer.run_dir; "
        f"every trainer.save_every={cfg.trainer.save_every} steps",
        *_checkpoint_io_lines(plan),
        engine_line,
        *_routes_lines(plan),
        *offload_lines,
        *(_no_critic_lines(plan, cfg) if plan.with_critic is not None else []),
        (f"assumptions: {' and '.join(models)} parameters, gradients and optimizer state stay on every GPU during "
         "training and leave it during rollout, parameters and optimizer state to host memory, the gradient buffers "
         "freed (trainer.offload_during_rollout)" if plan.offload else
         f"assumptions: {' and '.join(models)} parameters, gradients and optimizer state stay on every GPU in both "
         "phases (trainer.offload_during_rollout=false)")
        + "; during training the engine has released weights, KV cache and CUDA graphs; during rollout no "
        "activations are held (the trainer empties its allocator cache at each switch); one engine TP rank per GPU; "
        "flash attention.",
        "",
    ]
    if plan.problems:
        lines.append("DOES NOT FIT:")
        lines += [f"  - {p}" for p in plan.problems]
    else:
        tr = max(plan.ranks, key=lambda m: m.training)
        ro = max(plan.ranks, key=lambda m: m.rollout)
        lines.append(f"fits: training peak {tr.training / GIB:.1f} GiB ({tr.where()}), "
                     f"rollout peak {ro.rollout / GIB:.1f} GiB, of {plan.gpu_bytes / GIB:.1f} GiB per GPU")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:,.1f} min" if seconds >= 120 else f"{seconds:,.1f} s"


def format_step_time(est, cfg: Config, *, critic_delta_s: float | None = None) -> str:
    """The step-time table (sizing/step_time.py): each phase's seconds, share and what it is made of;
    then step time, tokens/s/GPU and the run's wall time and GPU-hours."""
    s, gpu = est.setup, est.gpu
    r = cfg.rollout
    from vapo_megatron.sizing.step_config import default_prompt_tokens, default_response_tokens

    response = ("the default of --mean-response-tokens: rollout.max_new_tokens / 4"
                if s.response_tokens == default_response_tokens(r.max_new_tokens) else "--mean-response-tokens")
    prompt = ("the default of --mean-prompt-tokens: 200, at most data.max_prompt_tokens"
              if s.prompt_tokens == default_prompt_tokens(cfg.data.max_prompt_tokens) else "--mean-prompt-tokens")
    lines = [
        f"step time on {s.world} x {gpu.name} (--gpu): computed from shapes and datasheet rates at the efficiencies in "
        "vapo_megatron/sizing/step_time.py; nothing here ran on a GPU (docs/slurm.md, \"Step time and cost\")",
        f"  responses: mean {s.response_tokens:,.0f} tokens ({response}), longest {s.max_response_tokens:,} "
        f"(rollout.max_new_tokens); prompts: mean {s.prompt_tokens:,.0f} tokens ({prompt}); "
        f"{s.samples:,} samples per step",
        f"  {'phase (perf/<phase>_s)':<22}{'seconds':>9}{'share':>8}  how",
    ]
    for name, phase in est.phases.items():
        lines.append(f"  {name:<22}{phase.seconds:9.1f}{est.share(name):8.1%}  {phase.how}")
    lines.append(f"  {'step':<22}{est.step_s:9.1f}{1:8.0%}  = {_duration(est.step_s)}")
    lines.append(f"tokens/s/GPU: {est.tokens_per_s_per_gpu:,.0f} (prompt + response tokens of a step / (step time x "
                 f"{s.world} GPUs), NeMo-RL's definition)")
    if s.critic_layout is not None:
        from vapo_megatron.sizing.step_time import critic_layout_text, mfu

        lines.append(f"  the critic at its own layout {critic_layout_text(s)} (critic.parallel): its values "
                     f"{est.critic_forward_s:,.1f} s of the score phase, its update "
                     f"{est.phases['critic_update'].seconds:,.1f} s; modelled from its FLOPs at MFU "
                     f"{mfu(s.critic):.2f} whatever its TP (a small model's lower efficiency at a high TP is not "
                     "priced), with its own pipeline bubble, micro-batches per DP rank and gradient sync")
    if r.dynamic_sampling:
        lines.append("  rollout.dynamic_sampling: each extra generation round adds a rollout phase (one round assumed)")
    other = est.rollout_sync_s if s.partial else est.rollout_partial_s
    other_step = est.step_s - est.phases["rollout"].seconds + other
    sync_step, partial_step = (other_step, est.step_s) if s.partial else (est.step_s, other_step)
    lines.append(f"  partial rollout (rollout.partial.enabled={'true' if s.partial else 'false'}; spare_batches="
                 f"{s.spare_batches}, max_staleness={s.max_staleness}): step {_duration(partial_step)} against "
                 f"{_duration(sync_step)} synchronous (x{sync_step / partial_step:.2f}; rollout "
                 f"{est.rollout_partial_s:,.1f} s against {est.rollout_sync_s:,.1f} s): the longest answer no longer "
                 f"decodes alone at the end of every step")
    if critic_delta_s is not None:
        lines.append(f"  no critic (algo.estimator=grpo): a critic would add {critic_delta_s:,.1f} s per step "
                     "(its forward at scoring and its update)")
    pretrain = (f"{s.value_pretrain_steps} value-pretraining iterations of {est.pretrain_step_s:,.0f} s (no actor "
                "update) + ") if s.value_pretrain_steps else ""
    evals = (f" + {s.evals} evaluations of {est.eval_s:,.0f} s ({s.eval_prompts:,} prompts (--eval-prompts) x "
             f"{1 + s.eval_samples} responses: 1 greedy + {s.eval_samples} sampled)") if s.evals else ""
    lines.append(f"run: {pretrain}{s.total_steps} iterations{evals} = {_duration(est.run_s)} wall, "
                 f"{est.run_gpu_hours:,.0f} GPU-hours on {s.world} GPUs (requeue gaps and engine start-up not counted)")
    return "\n".join(lines)


__all__ = ["format_plan", "format_step_time"]
