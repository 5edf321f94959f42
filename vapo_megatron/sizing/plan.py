"""The plan: each rank's memory in the two phases of a colocated run, and what does not fit.

  training  actor + critic parameters, gradients and optimizer state + the activations of the
            one model being trained; the colocated engine (SGLang) has released its weights, KV
            cache and CUDA graphs (rollout/generator.py: the engine releases its memory after each
            generation).
  rollout   the engine's static share and what it holds, as its record says (rollout/engines.py
            gpu_memory; SGLang: rollout.sglang.mem_fraction x GPU memory, its KV cache that share
            minus its weights: actor parameters in bf16 / rollout.sglang.tp per GPU),
            + the trainer's state unless trainer.offload_during_rollout moves it to host memory
            first (mcore/offload.py; RankMemory.offloaded names it). Assumes one engine TP rank on
            every GPU. RankMemory.kv_resume names what is left on the GPU when the owner resumes
            the KV cache, after every rank of its engine has emptied PyTorch's cache (sync_freed):
            the trainer's live state (none with the offload), CUDA and NCCL contexts,
            fragmentation. Plan.freed_before_resume names the transients emptied by then, which
            are not counted. Plan.kv_compare: the KV cache with and without the offload at this
            config's rollout peak (the share moves by the trainer's state).
The models are the actor and, with algo.estimator=gae, the critic: with grpo (GRPO, DAPO) there is
no critic at all (Plan.models), so none of its state, activations or checkpoint bytes, and
Plan.with_critic is the same config with a critic (its optimizer sharded like the actor's), sized
at this plan's rollout peak, to compare.
A critic at its own layout (critic.parallel) lives on the same GPUs: its shards are built at its
own TP/PP/VPP/EP, its state sharded over its own DP, its activations those of its own stages, and
each GPU holds the actor's shard of its actor position and the critic's of its critic position
(shards.paired_positions): the two models' resident state adds, the training peak takes the larger
model's activations (they train one after the other), and the critic's own process groups add
their NCCL buffers to the reserve. critic.parallel null: the critic at the actor's layout, as before.
All figures are computed from shapes and the estimates in memory.py, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vapo_megatron.config import Config
from vapo_megatron.config.engines import engine_key, engine_of, engine_settings, engine_tp
from vapo_megatron.config.estimators import estimator_of
from vapo_megatron.config.layout import critic_parallel, own_critic_layout
from vapo_megatron.mcore.dtypes import torch_dtype
from vapo_megatron.rollout.engines import record_of
from vapo_megatron.sizing.memory import (
    GIB,
    ROUTES_DEVICE_ITEM,
    SGLANG_RUNTIME_ITEM,
    activation_parts,
    checkpoint_bytes,
    checkpoint_parts,
    critic_group_count,
    reserve_parts,
    route_parts,
    sglang_stash_bytes,
    state_bytes,
)
from vapo_megatron.sizing.shards import ShardSize, critic_shard_sizes, paired_positions, shard_sizes


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank position; parts maps a component name to bytes ("actor parameters", ...;
    "actor activations, recompute: <item>" itemises the activations by memory.activation_parts)."""

    tp_rank: int
    pp_rank: int
    parts: dict
    training: int  # resident state + the larger of the two models' activations + reserve
    rollout: int  # resident state + the engine's share + reserve
    reserve: dict  # phase -> {item: bytes}
    # What the GPU still holds when the owner resumes the KV cache, by name:
    # rollout = sum(kv_resume) + the engine's static share + SGLang's runtime buffers.
    kv_resume: dict
    # The trainer's state moved to host memory during rollout (trainer.offload_during_rollout), by name.
    offloaded: dict = field(default_factory=dict)
    # A checkpoint's save and load beyond the state (memory.checkpoint_parts), the larger model's:
    # the models are saved and loaded one after the other.
    checkpoint_io: dict = field(default_factory=dict)
    # With critic.parallel: the critic's position on this GPU, at its own layout (None: the actor's).
    critic_tp_rank: int | None = None
    critic_pp_rank: int | None = None

    def where(self) -> str:
        """The GPU's position(s), as the report and the messages name it."""
        own = "" if self.critic_pp_rank is None else f"; critic tp={self.critic_tp_rank} pp={self.critic_pp_rank}"
        return f"tp={self.tp_rank} pp={self.pp_rank}{own}"


@dataclass(frozen=True)
class Plan:
    world_size: int
    gpu_bytes: int
    flat_reserve: int | None  # --reserve-gib, replacing the itemised reserve
    layout: tuple[int, int, int, int | None]  # tp, pp, dp, vpp
    shards: list[ShardSize]
    ranks: list[RankMemory]
    engine_weights: int  # per GPU
    engine_share: int  # per GPU: the engine's static share (SGLang: rollout.sglang.mem_fraction x GPU memory)
    kv_cache: int  # per GPU
    kv_tokens: int  # per engine (= per GPU: every engine rank holds its share of every token)
    sequence_tokens: int
    checkpoint: int  # bytes of one checkpoint (all ranks)
    # Transients emptied on every rank before the owner resumes the KV cache: named, not counted
    # in the rollout phase (bytes; None where the size depends on the data).
    freed_before_resume: dict
    problems: list[str]
    offload: bool = False  # trainer.offload_during_rollout
    # "offloaded" / "resident" -> {share, fraction, kv_cache, kv_tokens, sequences, configured}: SGLang's
    # share and KV cache per GPU with and without the offload at the same rollout peak ("peak": this
    # config's, or the GPU's memory when it does not fit); colocated only.
    kv_compare: dict = field(default_factory=dict)
    state_per_gpu: int = 0  # the trainer's state on the worst rank: what the offload frees on the GPU
    # ... of which the offload copies to pinned host memory (parameters and optimizer state; the
    # gradient buffers are freed without a copy and come back zeroed, mcore/offload.py)
    host_per_gpu: int = 0
    ep: int = 1  # parallel.ep: the routed experts split over EP ranks of DP (expert-DP = DP / EP)
    models: tuple[str, ...] = ("actor", "critic")  # ("actor",) with algo.estimator=grpo: no critic
    # algo.estimator=grpo: the same config with algo.estimator=gae (a critic), its kv_compare at this
    # plan's rollout peak; None with a critic.
    with_critic: Plan | None = None
    # Routing replay (memory.route_parts) on the worst rank: its host items ({} when off; the
    # device item is in each rank's training reserve).
    routes_host: dict = field(default_factory=dict)
    # critic.parallel: the critic's own (tp, pp, dp, vpp, ep) and its shards at that layout (`shards`
    # then holds the actor's alone); None: the critic at the actor's layout, its counts in `shards`.
    critic_layout: tuple[int, int, int, int | None, int] | None = None
    critic_shards: list[ShardSize] | None = None

    def model_shards(self, name: str) -> list[ShardSize]:
        """The shards that hold model `name`'s counts ("actor" or "critic")."""
        return self.critic_shards if name == "critic" and self.critic_shards is not None else self.shards


def _padded_vocab(hf_cfg: dict, tp: int) -> int:
    from vapo_megatron.mcore.models import padded_vocab_size

    return padded_vocab_size(hf_cfg, tp)


STATE = ("parameters", "gradients", "optimizer state")  # per model: what the offload frees, training keeps
HOST_STATE = ("parameters", "optimizer state")  # per model: what the offload copies to the host


def make_plan(cfg: Config, actor_hf: dict, critic_hf: dict, *, world_size: int, gpu_memory_gib: float,
              reserve_gib: float | None = None, peak: int | None = None, shards: list[ShardSize] | None = None,
              critic_shards: list[ShardSize] | None = None) -> Plan:
    """Size `cfg` for `world_size` GPUs; `problems` lists what does not fit (empty: it fits).
    critic_hf is the critic's model, unused with algo.estimator=grpo (no critic). peak: the rollout
    peak of kv_compare (default: this plan's own, at most the GPU). shards: this layout's, with the
    critic's counts even under grpo (the actor's trunk as critic, for with_critic), when the caller
    has them (vapo-plan --search: sizing/layer_counts.py); None: built here (shards.py). With
    critic.parallel the critic's counts come from critic_shards (its own layout's; None: built
    here), never from `shards`."""
    given = shards
    tp, pp, vpp, ep = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.ep
    dp = world_size // (tp * pp)
    params_dtype = torch_dtype(cfg.model.dtype)
    dtype_bytes = params_dtype.itemsize
    has_critic = estimator_of(cfg).needs_critic
    own = has_critic and own_critic_layout(cfg)
    c = critic_parallel(cfg) if own else cfg.parallel
    c_dp = world_size // (c.tp * c.pp)
    if shards is None:
        shards = shard_sizes(actor_hf, critic_hf if has_critic and not own else None, world_size=world_size, tp=tp,
                             pp=pp, vpp=vpp, params_dtype=params_dtype, ep=ep,
                             sequence_parallel=cfg.parallel.sequence_parallel and tp > 1)
    if not own:
        critic_shards = None
    elif critic_shards is None:
        critic_shards = critic_shard_sizes(critic_hf, world_size=world_size, tp=c.tp, pp=c.pp, vpp=c.vpp,
                                           params_dtype=params_dtype, ep=c.ep,
                                           sequence_parallel=c.sequence_parallel and c.tp > 1)
    # Each GPU's (actor shard, critic shard); at one layout, the same position for both.
    pairs = (paired_positions(world_size, (tp, pp), (c.tp, c.pp), shards, critic_shards) if own
             else [(s, s) for s in shards])
    sp = cfg.parallel.sequence_parallel and tp > 1  # off at tp=1 (config/schema.py)
    layouts = {"actor": (tp, pp, vpp, ep, dp, sp),
               "critic": (c.tp, c.pp, c.vpp, c.ep, c_dp, c.sequence_parallel and c.tp > 1)}
    critic_groups = critic_group_count((tp, pp, dp, ep), (c.tp, c.pp, c_dp, c.ep)) if own else 0
    models = ((("actor", actor_hf, cfg.actor_optim),)
              + ((("critic", critic_hf, cfg.critic_optim),) if has_critic else ()))
    names = tuple(name for name, _, _ in models)
    gpu = int(gpu_memory_gib * GIB)
    flat = None if reserve_gib is None else int(reserve_gib * GIB)
    r, engine = cfg.rollout, engine_of(cfg)
    colocated = engine.colocated  # embedded: a CPU/test engine; sglang_http: servers elsewhere (none sized)
    mem = record_of(cfg).gpu_memory(cfg, gpu_bytes=gpu, actor_params=sum(s.actor_unique for s in shards),
                                    actor_hf=actor_hf)
    engine_share, engine_weights, kv_cache, kv_tokens = mem.share, mem.weights, mem.kv_cache, mem.kv_tokens
    sequence = cfg.data.max_prompt_tokens + r.max_new_tokens
    T = cfg.trainer.micro_batch_tokens
    recompute = cfg.model.recompute_activations
    offload = cfg.trainer.offload_during_rollout

    ranks, routes_host = [], {}
    for a_shard, c_shard in pairs:
        parts: dict[str, int] = {}
        io: dict[str, int] = {}
        for name, hf_cfg, optim in models:
            s = a_shard if name == "actor" else c_shard
            m_tp, m_pp, m_vpp, m_ep, m_dp, m_sp = layouts[name]  # this model's layout
            n, n_expert = getattr(s, f"{name}_params"), getattr(s, f"{name}_expert")
            p, g, o = state_bytes(n, dtype_bytes=dtype_bytes, dp=m_dp,
                                  distributed_optimizer=optim.distributed_optimizer, expert_params=n_expert, ep=m_ep)
            mine = checkpoint_parts(params=n, expert_params=n_expert, written_params=getattr(s, f"{name}_unique")
                                    - n_expert * (m_ep - 1), largest=getattr(s, f"{name}_largest"),
                                    merged=getattr(s, f"{name}_merged"), dtype_bytes=dtype_bytes, dp=m_dp, ep=m_ep,
                                    distributed_optimizer=optim.distributed_optimizer)
            io = {k: max(v, io.get(k, 0)) for k, v in mine.items()}
            last = s.pp_rank == m_pp - 1
            vocab = 0 if name == "critic" or not last else _padded_vocab(hf_cfg, m_tp)
            items = {rc: activation_parts(hf_cfg, tokens=T, tp=m_tp, pp=m_pp, vpp=m_vpp,
                                          inflight_microbatches=s.inflight_microbatches, dtype_bytes=dtype_bytes,
                                          recompute=rc, logits_vocab=vocab, sequence_parallel=m_sp,
                                          chunk_tokens=cfg.trainer.logprob_chunk_tokens) for rc in (True, False)}
            act = {rc: sum(items[rc].values()) for rc in (True, False)}
            parts.update({f"{name} count": n, f"{name} expert count": n_expert, f"{name} parameters": p,
                          f"{name} gradients": g, f"{name} optimizer state": o,
                          f"{name} activations": act[recompute], f"{name} activations, recompute": act[True],
                          f"{name} activations, no recompute": act[False]})
            for rc, label in ((True, "recompute"), (False, "no recompute")):
                parts.update({f"{name} activations, {label}: {item}": v for item, v in items[rc].items()})
        state_names = [f"{m} {k}" for m in names for k in STATE]
        resident = sum(parts[k] for k in state_names)
        act = max(parts[f"{m} activations"] for m in names)
        routes = route_parts(cfg, actor_hf, dp=dp, inflight_microbatches=a_shard.inflight_microbatches)
        routes_host = max(routes_host, {k: v for k, v in routes.items() if k != ROUTES_DEVICE_ITEM},
                          key=lambda d: sum(d.values()))
        reserve = {ph: {"--reserve-gib": flat} if flat is not None else
                   reserve_parts(cfg, world_size=world_size, dp=dp, activations=act, phase=ph,
                                 engine_stash=sglang_stash_bytes(actor_hf),
                                 replay_bytes=routes.get(ROUTES_DEVICE_ITEM, 0), critic_groups=critic_groups)
                   for ph in ("training", "rollout")}
        state = {k.replace("gradients", "gradient buffers (fp32 main_grad)"): parts[k] for k in state_names}
        kv_resume = {} if offload else dict(state)
        kv_resume.update({k: v for k, v in reserve["rollout"].items() if k != SGLANG_RUNTIME_ITEM})
        runtime = reserve["rollout"].get(SGLANG_RUNTIME_ITEM, 0)
        ranks.append(RankMemory(a_shard.tp_rank, a_shard.pp_rank, parts,
                                resident + act + sum(reserve["training"].values()),
                                sum(kv_resume.values()) + engine_share + runtime, reserve, kv_resume,
                                offloaded=state if offload else {}, checkpoint_io=io,
                                critic_tp_rank=c_shard.tp_rank if own else None,
                                critic_pp_rank=c_shard.pp_rank if own else None))

    problems = []
    for phase in ("training", "rollout"):
        worst = max(ranks, key=lambda m: getattr(m, phase))
        need = getattr(worst, phase)
        if need > gpu:
            problems.append(_overflow_message(phase, worst, need, gpu, sum(worst.reserve[phase].values()), engine_share,
                                              recompute, names, cfg))
    if colocated:
        share_key, tp_key = engine_key(cfg, "mem_fraction"), engine_key(cfg, "tp")
        fraction = engine_settings(cfg).mem_fraction
        if kv_cache <= 0:
            problems.append(f"rollout: the {engine.label} engine's share {share_key}={fraction} x "
                            f"{gpu / GIB:.1f} GiB = {engine_share / GIB:.1f} GiB does not hold its weights "
                            f"({engine_weights / GIB:.1f} GiB per GPU at {tp_key}={engine_tp(cfg)}): no room for a KV "
                            f"cache (short by {-kv_cache / GIB:.1f} GiB); raise {share_key} or {tp_key}")
        elif kv_tokens < sequence:
            problems.append(f"rollout: the {engine.label} KV cache holds {kv_tokens} tokens per engine, less than one "
                            f"full sequence of data.max_prompt_tokens + rollout.max_new_tokens = {sequence}; raise "
                            f"{share_key} or {tp_key}")
    held = {"actor": shards, "critic": critic_shards if own else shards}  # the shards with each model's counts
    ckpt = checkpoint_bytes(sum(getattr(s, f"{m}_unique") for m in names for s in held[m]), dtype_bytes=dtype_bytes)
    # The weight sync's bound (rollout/weight_sync.py, SyncStats.bound): the bucket, and the largest
    # full tensor gathered from its TP shards, the embedding or output layer [padded vocab, h].
    largest = _padded_vocab(actor_hf, tp) * actor_hf["hidden_size"] * dtype_bytes
    freed = {f"weight-sync bucket (rollout.weight_sync_bucket_mb="
             f"{r.weight_sync_bucket_mb})": r.weight_sync_bucket_mb << 20,
             "gathered embedding/output layer (the sync's largest full tensor)": largest,
             "all_gather_object receive buffers (group size x largest object)": None}
    state = [sum(m.parts[f"{a} {k}"] for a in names for k in STATE) for m in ranks]
    host = max(sum(m.parts[f"{a} {k}"] for a in names for k in HOST_STATE) for m in ranks)
    compare = _kv_compare(ranks, state, offload=offload, engine_share=engine_share, engine_weights=engine_weights,
                          gpu=gpu, per_token=mem.per_token, sequence=sequence,
                          peak=peak) if colocated else {}
    if colocated and not offload and any(p.startswith("rollout") for p in problems):
        problems.append("rollout: trainer.offload_during_rollout=true would move the trainer's "
                        f"{max(state) / GIB:.1f} GiB per GPU to host memory during rollout")
    with_critic = None
    if not has_critic:  # the same config with a critic (optimizer sharded as the actor's), at this plan's rollout peak
        gae = replace(cfg, algo=replace(cfg.algo, estimator="gae"), critic_optim=replace(
            cfg.critic_optim, distributed_optimizer=cfg.actor_optim.distributed_optimizer),
            critic=replace(cfg.critic, parallel=None))  # the actor's trunk at the actor's layout
        with_critic = make_plan(gae, actor_hf, actor_hf, world_size=world_size, gpu_memory_gib=gpu_memory_gib,
                                reserve_gib=reserve_gib, peak=compare.get("peak"), shards=given)
    return Plan(world_size, gpu, flat, (tp, pp, dp, vpp), shards, ranks, engine_weights, engine_share,
                kv_cache, kv_tokens, sequence, ckpt, freed, problems, offload, compare, max(state), host, ep, names,
                with_critic, routes_host, critic_layout=(c.tp, c.pp, c_dp, c.vpp, c.ep) if own else None,
                critic_shards=critic_shards)


def _kv_compare(ranks: list[RankMemory], state: list[int], *, offload: bool, engine_share: int, engine_weights: int,
                gpu: int, per_token: int, sequence: int, peak: int | None = None) -> dict:
    """SGLang's share and KV cache per GPU with and without the offload, at the same rollout peak
    (the worst rank's): this config's when it fits (its share is then one of the two; the other
    differs by what the trainer's state adds to the worst rank, 24 GiB per GPU for the 32B config),
    else the GPU's memory (the largest shares that fit); or `peak` when given."""
    rest = [m.rollout - engine_share - (0 if offload else s) for m, s in zip(ranks, state)]  # without state and share
    peak = min(max(m.rollout for m in ranks), gpu) if peak is None else peak
    shares = {"offloaded": peak - max(rest), "resident": peak - max(r + s for r, s in zip(rest, state))}
    out = {"peak": peak}
    for way, share in shares.items():
        kv = share - engine_weights
        tokens = max(0, kv) // per_token
        out[way] = {"share": share, "fraction": share / gpu, "kv_cache": kv, "kv_tokens": tokens,
                    "sequences": tokens // sequence, "configured": share == engine_share}
    return out


def _overflow_message(phase: str, m: RankMemory, need: int, gpu: int, reserve: int, engine_share: int,
                      recompute: bool, names: tuple[str, ...], cfg: Config) -> str:
    items = {f"{a} {k}": m.parts[f"{a} {k}"] for a in names for k in STATE if not (phase == "rollout" and m.offloaded)}
    if phase == "training":
        model = max(names, key=lambda a: m.parts[f"{a} activations"])  # the actor on a tie
        items[f"{model} activations"
              + (" (full recompute)" if recompute else " (no recompute)")] = m.parts[f"{model} activations"]
    elif engine_of(cfg).colocated:
        items[f"{engine_of(cfg).label} engine ({engine_key(cfg, 'mem_fraction')} x GPU)"] = engine_share
    items["reserve"] = reserve
    top = sorted(items.items(), key=lambda kv: -kv[1])[:3]
    hint = ""
    if phase == "training" and not recompute:
        hint = "; model.recompute_activations=true would cut activations"
    return (f"{phase} does not fit on rank {m.where()}: needs {need / GIB:.1f} GiB of "
            f"{gpu / GIB:.1f} GiB ({(need - gpu) / GIB:.1f} GiB over); largest parts: "
            + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in top) + hint)


def resident_rollout_problem(cfg: Config, *, state_bytes: int, gpu_bytes: int, world_size: int) -> str | None:
    """vapo-train's start-up form of the plan's rollout phase without the offload (make_plan needs the
    model's shapes; here the trainer's state is measured: mcore/offload.py host_bytes of the worst
    rank): with a colocated engine and trainer.offload_during_rollout=false, the trainer's state stays
    on the GPU while the engine resumes its share (its record's: rollout.sglang.mem_fraction x GPU
    memory) and needs the reserve besides (memory.reserve_parts). A message naming both keys, or None."""
    if not engine_of(cfg).colocated or cfg.trainer.offload_during_rollout:
        return None
    dp = max(1, world_size // (cfg.parallel.tp * cfg.parallel.pp))
    reserve = sum(reserve_parts(cfg, world_size=world_size, dp=dp, activations=0, phase="rollout").values())
    share = record_of(cfg).share(cfg, gpu_bytes)
    key = engine_key(cfg, "mem_fraction")
    need = state_bytes + share + reserve
    if need <= gpu_bytes:
        return None
    fits = (gpu_bytes - state_bytes - reserve) * 100 // gpu_bytes / 100  # rounded down
    lower = f"lower {key} to at most {fits:.2f}" if fits > 0 else "use more GPUs"
    return (f"{key}={engine_settings(cfg).mem_fraction} with trainer.offload_during_rollout=false does not fit "
            f"the GPU at the KV cache's resume: the engine's share {share / GIB:.1f} GiB + the trainer's state "
            f"{state_bytes / GIB:.1f} GiB (the worst rank's, resident) + {reserve / GIB:.1f} GiB reserve = "
            f"{need / GIB:.1f} GiB > {gpu_bytes / GIB:.1f} GiB; set trainer.offload_during_rollout=true or {lower} "
            "(vapo-plan sizes both)")


def check_engine_share(cfg, models) -> None:
    """Collective over the world: with a colocated engine and trainer.offload_during_rollout
    off, raises the same ConfigError on every rank when the worst rank's resident state, the
    engine's share and the reserve exceed the GPU (resident_rollout_problem of the worst rank's state
    as mcore/offload.py host_bytes measures it). Only on CUDA: without it no colocated engine runs
    (config/preflight.py)."""
    import torch

    from vapo_megatron.config import ConfigError
    from vapo_megatron.mcore import offload, parallel

    if not torch.cuda.is_available() or not engine_of(cfg).colocated or cfg.trainer.offload_during_rollout:
        return
    mine = (offload.host_bytes(models), torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    group = parallel.wait_group()
    every: list = [None] * torch.distributed.get_world_size(group)
    parallel.all_gather_object(every, mine, group=group)
    problem = resident_rollout_problem(cfg, state_bytes=max(s for s, _ in every), gpu_bytes=min(g for _, g in every),
                                       world_size=torch.distributed.get_world_size())
    if problem:
        raise ConfigError(problem)


__all__ = ["Plan", "RankMemory", "check_engine_share", "make_plan", "resident_rollout_problem"]
