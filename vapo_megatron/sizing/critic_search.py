"""vapo-plan --search, second stage: the critic's own layout (critic.parallel) beside the fastest actor layouts.

The critic runs on the actor's GPUs at a layout of its own; its candidates, independent of the actor's:

  critic.parallel.tp   each divisor of the world whose TP group stays in one NVLink domain
  critic.parallel.pp   each PP dividing world / TP; no VPP (the bubble it would shorten is the critic's
                       update's alone, and it would multiply the candidates)
  critic.parallel.ep   a mixture-of-experts critic's: each divisor of its DP whose EP groups stay in one
                       node; 1 for a dense one
  sequence parallelism on wherever TP > 1; and null, the critic at the actor's layout

those that split the critic's model (layout_problems at critic.parallel.*), each tried beside the
PAIRED fastest actor layouts of the ranking and the config's own (when it fits) through the checks,
the memory check and the step time of one config (search.evaluate). Why only beside a few: the
critic's seconds depend on its own layout and on settings every row shares (recompute, micro-batch
tokens, the batch), not on the actor's layout, which couples in through memory only (both models'
state on every GPU, the offload's bytes). A pair is ranked by step time, then by its lower peak.
Every second is the step-time model's (FLOPs at an assumed MFU; step_time.py), nothing measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vapo_megatron.config import Config
from vapo_megatron.config.schema import ParallelConfig
from vapo_megatron.sizing.hardware import on_nvlink

PAIRED = 5  # the fastest actor layouts the critic's layouts are tried beside (and the config's own)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def critic_candidates(critic_hf: dict, *, world: int, a) -> list[ParallelConfig]:
    """Every critic layout of the module docstring whose sizes split the critic's model."""
    from vapo_megatron.config.layout import CRITIC_KEYS, layout_problems
    from vapo_megatron.sizing.memory import moe_architecture
    from vapo_megatron.sizing.report import ep_group_nodes

    moe = moe_architecture(critic_hf) is not None
    out = []
    for tp in (t for t in _divisors(world) if on_nvlink(a.gpu, t, a.gpus_per_node, world)):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            eps = [e for e in _divisors(dp)
                   if ep_group_nodes(tp=tp, pp=pp, dp=dp, ep=e, gpus_per_node=a.gpus_per_node) == 1] if moe else [1]
            out += [ParallelConfig(tp=tp, pp=pp, vpp=None, ep=ep, sequence_parallel=tp > 1) for ep in eps
                    if not layout_problems(world, tp, pp, None, model=critic_hf, keys=CRITIC_KEYS, ep=ep)]
    return out


def with_critic_layout(cfg: Config, layout: ParallelConfig | None) -> Config:
    """`cfg` with critic.parallel = `layout` (None: the actor's)."""
    return replace(cfg, critic=replace(cfg.critic, parallel=layout))


def critic_overrides(cfg: Config) -> tuple[str, ...]:
    """critic.parallel as vapo-plan's (and vapo-train's) overrides: every key (a key left out takes the
    section's default, not the actor's), or critic.parallel=null."""
    c = cfg.critic.parallel
    if c is None:
        return ("critic.parallel=null",)
    return (f"critic.parallel.tp={c.tp}", f"critic.parallel.pp={c.pp}",
            f"critic.parallel.vpp={'null' if c.vpp is None else c.vpp}", f"critic.parallel.ep={c.ep}",
            f"critic.parallel.sequence_parallel={str(c.sequence_parallel and c.tp > 1).lower()}")


@dataclass
class CriticSearch:
    """The critic's layouts beside each paired actor layout (`pairs`: actor row -> its rows, fastest
    fitting first, then those that do not fit, then those refused) and the fastest pair."""

    candidates: int  # critic layouts per actor layout, null included
    paired: int = 0  # the fastest actor layouts tried
    with_own: bool = False  # and the config's own, not among them
    pairs: list[tuple[object, list]] = field(default_factory=list)  # (actor Row, [Row with critic.parallel])
    best: object | None = None  # the fastest fitting pair's Row
    tried: int = 0
    refused: int = 0
    too_big: int = 0

    def rows_for(self, actor_row) -> list | None:
        return next((rows for r, rows in self.pairs if r is actor_row), None)


def search_critic(result, cfg: Config, actor_hf: dict, critic_hf: dict, *, world: int, a, shards_cache: dict,
                  evaluate, paired: int = PAIRED) -> CriticSearch:
    """The second stage (module docstring) on a finished actor ranking `result` (search.Search);
    `evaluate`: search.evaluate, passed in (search.py imports this module, not the other way)."""
    layouts = [None, *critic_candidates(critic_hf, world=world, a=a)]
    out = CriticSearch(candidates=len(layouts))
    actors = list(result.rows[:paired])
    out.paired, out.with_own = len(actors), result.own.fits and result.own not in actors
    if out.with_own:
        actors.append(result.own)
    for actor in actors:
        rows = []
        for layout in layouts:
            if layout is not None and layout == actor.cfg.parallel:
                continue  # the actor's own sizes: the same as null
            c = with_critic_layout(actor.cfg, layout)
            row = actor if c.critic.parallel == actor.cfg.critic.parallel else evaluate(
                c, actor_hf, critic_hf, world=world, a=a, shards_cache=shards_cache)
            out.tried += 1
            out.refused += row.plan is None
            out.too_big += row.plan is not None and not row.fits
            rows.append(row)
        # The fitting fastest first, then those too big, closest first, then those the checks refused.
        rows.sort(key=lambda r: (0, r.estimate.step_s, _peak(r)) if r.fits else (1, 0.0, _peak(r)) if r.plan
                  else (2, 0.0, 0))
        out.pairs.append((actor, rows))
    fitting = [r for _, rows in out.pairs for r in rows if r.fits]
    out.best = min(fitting, key=lambda r: (r.estimate.step_s, _peak(r))) if fitting else None
    return out


def _peak(row) -> int:
    return max(row.training_peak, row.rollout_peak)


def critic_state(row) -> int:
    """The critic's parameters, gradients and optimizer state on the worst GPU, bytes."""
    return max(sum(m.parts[f"critic {k}"] for k in ("parameters", "gradients", "optimizer state"))
               for m in row.plan.ranks)


def critic_record(row, world: int) -> dict | None:
    """A row's critic layout for --json: None at the actor's; else its sizes, DP and overrides."""
    c = row.cfg.critic.parallel
    if c is None or c == row.cfg.parallel:
        return None
    return {"tp": c.tp, "pp": c.pp, "vpp": c.vpp, "ep": c.ep, "sequence_parallel": c.sequence_parallel and c.tp > 1,
            "dp": world // (c.tp * c.pp), "overrides": list(critic_overrides(row.cfg))}


def pair_record(row, world: int) -> dict:
    """One critic layout beside an actor layout, for --json: its fit, peaks, critic seconds and step."""
    out = {"critic": critic_record(row, world), "overrides": list(critic_overrides(row.cfg)), "fits": row.fits}
    if row.plan is not None:
        out.update(training_peak_gib=round(row.training_peak / 2**30, 3),
                   rollout_peak_gib=round(row.rollout_peak / 2**30, 3))
    if not row.fits:
        out["problems"] = row.problems
        return out
    e = row.estimate
    out.update(critic_state_gib=round(critic_state(row) / 2**30, 3), critic_values_s=round(e.critic_forward_s, 3),
               critic_update_s=round(e.phases["critic_update"].seconds, 3), step_s=round(e.step_s, 3))
    return out


__all__ = ["PAIRED", "CriticSearch", "critic_candidates", "critic_overrides", "critic_record", "critic_state",
           "pair_record", "search_critic", "with_critic_layout"]
