"""vapo-plan --search: the layouts the trainer accepts on a cluster, those that fit, ranked by modelled step time.

The ranking is of the actor's layout; the critic, on the same GPUs, at the config's critic layout:
the actor's (critic.parallel null) or critic.parallel's; the optimizers (actor_optim, critic_optim)
stay as configured. Then the critic's own layouts are tried beside the fastest actor layouts
(sizing/critic_search.py; Search.critic). A candidate is the config with these settings replaced:

  parallel.tp                      each divisor of the world whose TP group stays in one NVLink
                                   domain (hardware.on_nvlink: a node; the model's MFUs come from
                                   runs that kept TP there, and it prices no TP traffic)
  parallel.pp, parallel.vpp        each PP dividing world / TP; VPP null or >= 2 dividing the layers per stage
  parallel.ep                      a mixture-of-experts model's: each divisor of DP whose EP groups stay
                                   in one node (report.ep_group_nodes); 1 for a dense model
  the engine's TP                  with a colocated engine (rollout.sglang.tp), each divisor of TP
  model.recompute_activations      off and on
  trainer.offload_during_rollout   off and on, with a colocated engine
  trainer.micro_batch_tokens       the config's, and one full sequence (the least the checks allow)
  parallel.sequence_parallel       on wherever TP > 1: the step-time model gives it no cost and it
                                   only lowers memory (megatron needs it for MoE at TP > 1)

Everything else is the config's, rollout.sglang.mem_fraction included (the engine's share: a
layout that does not fit at it is not listed; search again with another share as an override).
A candidate is kept when the checks vapo-plan applies to one config find nothing
(config/checks.py config_problems and config/preflight.py launch_problems: the trainer's layout,
MoE and batch checks, the engine's TP against node and heads) and make_plan, vapo-plan's memory
check, finds that both phases fit; it is timed as vapo-plan --gpu times one config
(step_config.plan_setup, step_time.estimate). The shards come from layer_counts.py, built once per
(TP, EP) and put together per layout, not per layout on the meta device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from vapo_megatron.config import Config
from vapo_megatron.config.engines import engine_key, engine_of, engine_tp, known_engine, with_engine_tp
from vapo_megatron.config.estimators import estimator_of
from vapo_megatron.sizing.hardware import GPU, on_nvlink


@dataclass(frozen=True)
class Assumptions:
    """What the step time and the memory check take besides the config: vapo-plan's options."""

    gpu: GPU
    gpus_per_node: int
    gpu_memory_gib: float
    reserve_gib: float | None = None
    response_tokens: float | None = None
    prompt_tokens: float | None = None
    storage_gb_s: float = 1.0
    eval_prompts: int | None = None


# A candidate's settings, in the order the records and overrides list them; ENGINE_TP stands for the
# colocated engine's tp (its section's key: rollout.sglang.tp), none for another engine.
ENGINE_TP = "engine_tp"
KEYS = ("parallel.tp", "parallel.pp", "parallel.vpp", "parallel.ep", "parallel.sequence_parallel", ENGINE_TP,
        "model.recompute_activations", "trainer.offload_during_rollout", "trainer.micro_batch_tokens")


def settings(cfg: Config) -> tuple:
    """A config's values of KEYS (sequence parallelism as it runs: off at TP=1; no engine TP but a
    colocated engine's)."""
    p = cfg.parallel
    return (p.tp, p.pp, p.vpp, p.ep, p.sequence_parallel and p.tp > 1, engine_tp(cfg),
            cfg.model.recompute_activations, cfg.trainer.offload_during_rollout, cfg.trainer.micro_batch_tokens)


def overrides(cfg: Config) -> tuple[str, ...]:
    """The candidate as vapo-plan's (and vapo-train's) key=value overrides."""
    def text(v) -> str:
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    colocated = engine_of(cfg).colocated
    return tuple(f"{engine_key(cfg, 'tp') if k == ENGINE_TP else k}={text(v)}" for k, v in zip(KEYS, settings(cfg))
                 if k != ENGINE_TP or colocated)


def with_settings(cfg: Config, tp: int, pp: int, vpp: int | None, ep: int, sp: bool, etp: int | None,
                  recompute: bool, offload: bool, micro_batch_tokens: int) -> Config:
    """`cfg` with these settings; etp: the colocated engine's TP (None, or an engine not colocated:
    left as it is)."""
    cfg = replace(cfg, parallel=replace(cfg.parallel, tp=tp, pp=pp, vpp=vpp, ep=ep, sequence_parallel=sp),
                  model=replace(cfg.model, recompute_activations=recompute),
                  trainer=replace(cfg.trainer, offload_during_rollout=offload, micro_batch_tokens=micro_batch_tokens))
    engine = known_engine(cfg)  # None: an unknown engine, which setting_problems reports
    return with_engine_tp(cfg, etp) if etp is not None and engine is not None and engine.colocated else cfg


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(cfg: Config, actor_hf: dict, *, world: int, a: Assumptions) -> list[Config]:
    """Every candidate (module docstring), the checks not yet applied."""
    from vapo_megatron.sizing.memory import moe_architecture
    from vapo_megatron.sizing.report import ep_group_nodes

    layers, moe = actor_hf["num_hidden_layers"], moe_architecture(actor_hf) is not None
    colocated = engine_of(cfg).colocated
    sequence = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    micro = sorted({cfg.trainer.micro_batch_tokens, sequence})
    out = []
    for tp in (t for t in _divisors(world) if on_nvlink(a.gpu, t, a.gpus_per_node, world)):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            vpps = [None] + ([v for v in _divisors(layers // pp) if v >= 2] if pp >= 2 and layers % pp == 0 else [])
            eps = [e for e in _divisors(dp)
                   if ep_group_nodes(tp=tp, pp=pp, dp=dp, ep=e, gpus_per_node=a.gpus_per_node) == 1] if moe else [1]
            for vpp in vpps:
                for ep in eps:
                    for etp in _divisors(tp) if colocated else [None]:
                        for recompute in (False, True):
                            for offload in (False, True) if colocated else [cfg.trainer.offload_during_rollout]:
                                for mbt in micro:
                                    out.append(with_settings(cfg, tp, pp, vpp, ep, tp > 1, etp, recompute, offload,
                                                             mbt))
    return out


@dataclass
class Row:
    """One candidate: refused by the checks (problems, no plan), too big (plan.problems), or fitting
    (an estimate). own: the config's own layout."""

    cfg: Config
    problems: list[str]
    plan: object | None = None  # sizing/plan.py Plan
    estimate: object | None = None  # sizing/step_time.py Estimate
    own: bool = False

    @property
    def fits(self) -> bool:
        return self.plan is not None and not self.problems

    @property
    def training_peak(self) -> int:
        return max(m.training for m in self.plan.ranks)

    @property
    def rollout_peak(self) -> int:
        return max(m.rollout for m in self.plan.ranks)

    @property
    def headroom(self) -> int:
        return self.plan.gpu_bytes - max(self.training_peak, self.rollout_peak)


@dataclass
class Search:
    world: int
    assumptions: Assumptions
    rows: list[Row]  # the candidates that fit, fastest first
    own: Row  # the config as given (also in rows when it is a candidate that fits)
    tried: int = 0
    refused: int = 0  # by the checks
    too_big: int = 0  # by the memory check
    closest: list[Row] = field(default_factory=list)  # of those that do not fit, the 3 with the lowest peak
    moe: bool = False  # EP was searched (a mixture-of-experts model)
    refusals: list[Row] = field(default_factory=list)  # the candidates the checks refused, in the order tried
    critic: object | None = None  # critic_search.CriticSearch: the critic's own layouts (None: no critic)

    @property
    def nothing_accepted(self) -> bool:
        """Every candidate refused by the checks: no layout on these GPUs can run the config's other
        settings, so the memory check never ran (vapo-plan exits 2, as for a setting no layout can fix)."""
        return self.tried > 0 and self.refused == self.tried

    @property
    def own_rank(self) -> int | None:
        """The config's place among the fitting layouts by step time (1 = fastest); None when it does not fit."""
        return self.rows.index(self.own) + 1 if self.own.fits else None


def setting_problems(cfg: Config) -> list[str]:
    """What no layout can fix: config_problems of the config at a layout every check accepts (one
    GPU's: TP, PP, EP and the engine's TP 1), so that the config's own layout is never among them."""
    from vapo_megatron.config.checks import config_problems

    neutral = with_settings(cfg, 1, 1, None, 1, False, 1, cfg.model.recompute_activations,
                            cfg.trainer.offload_during_rollout, cfg.trainer.micro_batch_tokens)
    return config_problems(neutral, check_paths=False)


def evaluate(cfg: Config, actor_hf: dict, critic_hf: dict, *, world: int, a: Assumptions, shards_cache: dict) -> Row:
    """One candidate through vapo-plan's checks, its memory check and (when it fits) its step time."""
    from vapo_megatron.config.checks import config_problems
    from vapo_megatron.config.layout import own_critic_layout
    from vapo_megatron.config.preflight import launch_problems
    from vapo_megatron.mcore.dtypes import torch_dtype
    from vapo_megatron.sizing.layer_counts import critic_layout_shards, layout_shards
    from vapo_megatron.sizing.plan import make_plan
    from vapo_megatron.sizing.step_config import plan_setup
    from vapo_megatron.sizing.step_time import estimate

    problems = config_problems(cfg, check_paths=False) + launch_problems(cfg, world, actor_hf, critic_hf,
                                                                         gpus_per_node=a.gpus_per_node)
    if problems:
        return Row(cfg, problems)
    p = cfg.parallel
    own = estimator_of(cfg).needs_critic and own_critic_layout(cfg)
    # The critic's counts even without one (make_plan's with_critic, grpo, uses them), but not at the
    # actor's layout when it has its own (which need not split it: the checks above did not ask).
    key = (p.tp, p.pp, p.vpp, p.ep, cfg.model.dtype) + (("actor alone",) if own else ())
    if key not in shards_cache:
        trunk = None if own else critic_hf if estimator_of(cfg).needs_critic else actor_hf
        shards_cache[key] = layout_shards(actor_hf, trunk, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep,
                                          params_dtype=torch_dtype(cfg.model.dtype),
                                          sequence_parallel=p.sequence_parallel)
    critic_shards = None
    if own:  # the critic's counts at its own layout
        c = cfg.critic.parallel
        ckey = ("critic", c.tp, c.pp, c.vpp, c.ep, cfg.model.dtype)
        if ckey not in shards_cache:
            shards_cache[ckey] = critic_layout_shards(critic_hf, tp=c.tp, pp=c.pp, vpp=c.vpp, ep=c.ep,
                                                      params_dtype=torch_dtype(cfg.model.dtype),
                                                      sequence_parallel=c.sequence_parallel)
        critic_shards = shards_cache[ckey]
    plan = make_plan(cfg, actor_hf, critic_hf, world_size=world, gpu_memory_gib=a.gpu_memory_gib,
                     reserve_gib=a.reserve_gib, shards=shards_cache[key], critic_shards=critic_shards)
    if plan.problems:
        return Row(cfg, list(plan.problems), plan)
    setup = plan_setup(cfg, plan, actor_hf, critic_hf, gpus_per_node=a.gpus_per_node, gpu=a.gpu,
                       response_tokens=a.response_tokens, prompt_tokens=a.prompt_tokens, storage_gb_s=a.storage_gb_s,
                       eval_prompts=a.eval_prompts)
    return Row(cfg, [], plan, estimate(a.gpu, setup))


def search(cfg: Config, actor_hf: dict, critic_hf: dict, *, world: int, a: Assumptions) -> Search:
    """Every candidate evaluated; the fitting ones ranked by step time (then by the lower peak)."""
    shards_cache: dict = {}
    own_settings = settings(cfg)
    own = evaluate(cfg, actor_hf, critic_hf, world=world, a=a, shards_cache=shards_cache)
    own.own = True
    from vapo_megatron.sizing.memory import moe_architecture

    result = Search(world, a, [], own, moe=moe_architecture(actor_hf) is not None)
    for c in candidates(cfg, actor_hf, world=world, a=a):
        row = own if settings(c) == own_settings else evaluate(c, actor_hf, critic_hf, world=world, a=a,
                                                                shards_cache=shards_cache)
        result.tried += 1
        if row.plan is None:
            result.refused += 1
            result.refusals.append(row)
        elif row.problems:
            result.too_big += 1
            result.closest = sorted([*result.closest, row], key=lambda r: max(r.training_peak, r.rollout_peak))[:3]
        else:
            result.rows.append(row)
    if own.fits and own not in result.rows:  # a layout outside the candidates (TP across nodes, ...)
        result.rows.append(own)
    result.rows.sort(key=lambda r: (r.estimate.step_s, max(r.training_peak, r.rollout_peak), not r.own))
    if estimator_of(cfg).needs_critic:
        from vapo_megatron.sizing.critic_search import search_critic

        result.critic = search_critic(result, cfg, actor_hf, critic_hf, world=world, a=a, shards_cache=shards_cache,
                                      evaluate=evaluate)
    return result


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass
class Cause:
    """One rule of the checks and the refused layouts that broke it. A problem's text with its numbers
    taken out is its rule ("parallel.pp=7 does not divide ..." and "parallel.pp=14 ..." are one), so
    the same rule at other TP, PP or DP groups together; `values` keeps, per number's place, the
    numbers seen there, and text() puts them back: the one number where all agree, else the set."""

    parts: tuple[str, ...]  # the problem's text around its numbers
    layouts: int = 0  # refused layouts with this cause (a layout can have several causes)
    values: list[set[str]] = field(default_factory=list)

    def text(self, shown: int = 6) -> str:
        def place(seen: set[str]) -> str:
            if len(seen) == 1:
                return next(iter(seen))
            ordered = sorted(seen, key=float)
            return "{" + ",".join(ordered[:shown]) + (",..." if len(ordered) > shown else "") + "}"
        out = [self.parts[0]]
        for seen, after in zip(self.values, self.parts[1:]):
            out += [place(seen), after]
        return "".join(out)


def refusal_causes(rows: list[Row]) -> list[Cause]:
    """The refused rows' problems grouped by rule (Cause), the most frequent first (ties: first met)."""
    causes: dict[tuple[str, ...], Cause] = {}
    for row in rows:
        counted = set()  # a layout counts once per cause, however many of its problems share the rule
        for problem in row.problems:
            parts, numbers = tuple(_NUMBER.split(problem)), _NUMBER.findall(problem)
            cause = causes.setdefault(parts, Cause(parts, 0, [set() for _ in numbers]))
            for seen, number in zip(cause.values, numbers):
                seen.add(number)
            if parts not in counted:
                counted.add(parts)
                cause.layouts += 1
    return sorted(causes.values(), key=lambda c: -c.layouts)


def closest_refused(result: Search, n: int = 3) -> list[Row]:
    """The n refused layouts nearest to running: the fewest problems, then the fewest settings changed
    from the config's own. Those whose rules (Cause) differ from the ones already chosen come first,
    so that the n name n different obstacles where there are that many."""
    own = settings(result.own.cfg)
    ranked = sorted(result.refusals, key=lambda r: (len(r.problems), sum(a != b for a, b in zip(settings(r.cfg), own))))
    rules = [frozenset(tuple(_NUMBER.split(p)) for p in r.problems) for r in ranked]
    chosen: list[int] = []
    for i, rule in enumerate(rules):
        if len(chosen) < n and all(rule != rules[j] for j in chosen):
            chosen.append(i)
    chosen += [i for i in range(len(ranked)) if i not in chosen][:n - len(chosen)]
    return [ranked[i] for i in sorted(chosen)]


def phase_deltas(row: Row, reference: Row) -> list[tuple[str, float]]:
    """(phase, seconds row - reference) for every phase of either, most negative (the biggest saving) first."""
    mine, theirs = row.estimate.phases, reference.estimate.phases
    names = list(dict.fromkeys([*theirs, *mine]))
    deltas = [(n, (mine[n].seconds if n in mine else 0.0) - (theirs[n].seconds if n in theirs else 0.0)) for n in names]
    return sorted(deltas, key=lambda d: d[1])


def gib(n: int) -> float:
    return n / float(1 << 30)


def record(row: Row, rank: int | None, reference: Row | None, result: Search | None = None) -> dict:
    """One layout as --json prints it (GiB and seconds; the phases in the trainer's order). dp is
    None where the layout is refused; vs_config_s: seconds against `reference` (the config's own).
    With `result`: the row's critic layout ("critic", None at the actor's) and, for an actor layout
    the critic's layouts were tried beside, those ("critic_layouts", fastest first)."""
    from vapo_megatron.sizing.critic_search import critic_record, pair_record

    keys = dict(zip(("tp", "pp", "vpp", "ep", "sequence_parallel", "engine_tp", "recompute", "offload",
                     "micro_batch_tokens"), settings(row.cfg)))
    out = {"rank": rank, "config": row.own, **keys, "dp": row.plan.layout[2] if row.plan is not None else None,
           "overrides": list(overrides(row.cfg)), "fits": row.fits}
    if result is not None and result.critic is not None:
        out["critic"] = critic_record(row, result.world)
        paired = result.critic.rows_for(row)
        if paired is not None:
            out["critic_layouts"] = [pair_record(r, result.world) for r in paired]
    if row.plan is not None:
        out.update(training_peak_gib=round(gib(row.training_peak), 3), rollout_peak_gib=round(gib(row.rollout_peak), 3),
                   peak_gib=round(gib(max(row.training_peak, row.rollout_peak)), 3),
                   headroom_gib=round(gib(row.headroom), 3), gpu_gib=round(gib(row.plan.gpu_bytes), 3),
                   kv_tokens_per_engine=row.plan.kv_tokens)
    if not row.fits:
        out["problems"] = row.problems
        return out
    e = row.estimate
    out.update(step_s=round(e.step_s, 3), phases_s={n: round(p.seconds, 3) for n, p in e.phases.items()},
               tokens_per_s_per_gpu=round(e.tokens_per_s_per_gpu, 1), run_gpu_hours=round(e.run_gpu_hours, 1))
    if reference is not None and reference.fits:
        out["vs_config_s"] = {"step": round(e.step_s - reference.estimate.step_s, 3),
                              **{n: round(d, 3) for n, d in phase_deltas(row, reference) if d}}
    return out


def records(result: Search, top: int) -> list[dict]:
    """The --json list: the top layouts by step time, then the config's own when it is not among them."""
    shown = result.rows[:top]
    ref = result.own if result.own.fits else None
    out = [record(r, i + 1, ref, result) for i, r in enumerate(shown)]
    if result.own not in shown:
        out.append(record(result.own, result.own_rank, ref, result))
    return out


__all__ = ["ENGINE_TP", "Assumptions", "Cause", "KEYS", "Row", "Search", "candidates", "closest_refused", "evaluate",
           "overrides", "phase_deltas", "record", "records", "refusal_causes", "search", "setting_problems", "settings",
           "with_settings"]
