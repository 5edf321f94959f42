"""vapo-plan --search's printout: the ranking as a table, the config's own place in it, and why the fastest is
faster."""

from __future__ import annotations

from vapo_megatron.config import Config
from vapo_megatron.config.engines import engine_key, engine_of, engine_settings, engine_tp
from vapo_megatron.config.estimators import estimator_of
from vapo_megatron.sizing.search import Row, Search, closest_refused, gib, overrides, phase_deltas, refusal_causes

# The step's phases shown in their own columns; the others (offload, onload, sync, checkpoint) are summed.
COLUMNS = (("rollout", "rollout"), ("score", "score"), ("critic_update", "critic"), ("actor_update", "actor"))


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _layout(row: Row) -> str:
    p = row.cfg.parallel
    ep = f" EP={p.ep}" if p.ep > 1 else ""
    return (f"TP={p.tp} PP={p.pp} VPP={p.vpp or '-'}{ep} engine TP={engine_tp(row.cfg)}, recompute "
            f"{_on(row.cfg.model.recompute_activations)}, offload {_on(row.cfg.trainer.offload_during_rollout)}, "
            f"micro_batch_tokens={row.cfg.trainer.micro_batch_tokens}")


def _main_phase(row: Row, reference: Row) -> str:
    """The step time against the reference and the phase that makes most of the difference."""
    step = row.estimate.step_s - reference.estimate.step_s
    if abs(step) < 0.05:
        return "="
    name, delta = phase_deltas(row, reference)[0 if step < 0 else -1]
    return f"{step:+,.0f} s ({name} {delta:+,.0f})"


def _row_line(row: Row, rank: int | None, reference: Row | None) -> str:
    p, e = row.cfg.parallel, row.estimate
    cells = [f"{rank if rank is not None else '-':>4}", f"{p.tp:>3}", f"{p.pp:>3}", f"{p.vpp or '-':>4}", f"{p.ep:>3}",
             f"{row.plan.layout[2]:>4}", f"{engine_tp(row.cfg) or '-':>4}",
             f"{_on(row.cfg.model.recompute_activations):>4}", f"{_on(row.cfg.trainer.offload_during_rollout):>4}",
             f"{row.cfg.trainer.micro_batch_tokens:>7}",
             f"{gib(row.training_peak):6.1f}", f"{gib(row.rollout_peak):6.1f}", f"{gib(row.headroom):5.1f}"]
    shown = 0.0
    for name, _ in COLUMNS:
        s = e.phases[name].seconds if name in e.phases else None
        shown += s or 0.0
        cells.append(f"{s:7.1f}" if s is not None else f"{'-':>7}")
    cells += [f"{e.step_s - shown:6.1f}", f"{e.step_s:7.1f}", f"{e.tokens_per_s_per_gpu:6.0f}",
              f"{e.run_gpu_hours:8,.0f}"]
    cells.append("  " + ("<- the config's layout" if row.own else _main_phase(row, reference) if reference else ""))
    return " ".join(cells)


HEADER = (f"{'rank':>4} {'TP':>3} {'PP':>3} {'VPP':>4} {'EP':>3} {'DP':>4} {'eTP':>4} {'rc':>4} {'off':>4} {'mbt':>7} "
          f"{'train':>6} {'roll':>6} {'free':>5} " + " ".join(f"{label:>7}" for _, label in COLUMNS)
          + f" {'other':>6} {'step s':>7} {'tok/s':>6} {'GPU-h':>8}  vs the config's layout")


def _why(best: Row, reference: Row, what: str) -> list[str]:
    """The phases that make the fastest layout faster than `reference`, each with both how-lines."""
    step = reference.estimate.step_s - best.estimate.step_s
    lines = [f"why the fastest is faster than {what} ({_layout(reference)}): {step:,.0f} s less per step "
             f"({step / reference.estimate.step_s:.0%})" + (":" if step >= 0.05 else "")]
    if step < 0.05:
        return lines
    for name, delta in phase_deltas(best, reference):
        if abs(delta) < max(0.05, 0.05 * step):  # the phases that make the difference
            continue
        mine, theirs = best.estimate.phases.get(name), reference.estimate.phases.get(name)
        lines.append(f"  {name} {theirs.seconds if theirs else 0:,.1f} -> {mine.seconds if mine else 0:,.1f} s "
                     f"({delta:+,.1f} s)")
        lines.append(f"    fastest: {mine.how if mine else '(no such phase)'}")
        lines.append(f"    {what.split(' (')[0]}: {theirs.how if theirs else '(no such phase)'}")
    return lines


def format_search(result: Search, cfg: Config, *, top: int, model_source: str, nodes: int, config_path: str,
                  rerun: str) -> str:
    """The ranking (the top `top` and the config's own), its assumptions and why the fastest is
    faster; `rerun`: the vapo-plan command line that shows one layout in full, less its overrides."""
    a, world = result.assumptions, result.world
    own = result.own
    micro = sorted({cfg.trainer.micro_batch_tokens, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens})
    lines = [
        f"vapo-plan --search: {nodes} node(s) x {a.gpus_per_node} GPUs = {world} GPUs of {a.gpu_memory_gib:.1f} GiB; "
        f"step time on {a.gpu.name} (--gpu)",
        f"model: {model_source}",
        _critic_note(cfg) if estimator_of(cfg).needs_critic else
        f"one layout for the actor (algo.estimator={cfg.algo.estimator}: no critic)",
        "searched: TP within one NVLink domain, PP, VPP, " + ("EP with its groups in one node, " if result.moe else "")
        + f"the engine's TP ({engine_key(cfg, 'tp')}, dividing TP), full recompute off and on, "
        + ("offload off and on, " if engine_of(cfg).colocated else "")
        + f"micro_batch_tokens {' and '.join(map(str, micro))}; sequence parallelism on wherever TP > 1; every other "
        f"setting as configured ({engine_key(cfg, 'mem_fraction')}={engine_settings(cfg).mem_fraction})",
        f"layouts: {result.tried:,} tried, {result.refused:,} refused by the checks vapo-plan applies (the trainer's), "
        f"{result.too_big:,} do not fit (its memory check), {len(result.rows):,} fit",
        "ranked by modelled step time: computed from shapes and datasheet rates at assumed efficiencies, nothing "
        "measured; a model until a GPU run checks it (docs/slurm.md, \"Choosing a layout\")",
        f"  eTP: {engine_key(cfg, 'tp')}; rc: full recompute; off: offload during rollout; mbt: micro_batch_tokens; "
        "GiB per GPU at the worst rank: train(ing) and roll(out) peaks, free = headroom; seconds per step: each "
        "phase, other = offload + onload + sync + checkpoint; tok/s per GPU; GPU-h of the whole run",
        "",
        HEADER,
    ]
    shown = result.rows[:top]
    reference = own if own.fits else None
    lines += [_row_line(r, i + 1, reference) for i, r in enumerate(shown)]
    if own.fits and own not in shown:
        lines.append(f"{'...':>4}")
        lines.append(_row_line(own, result.own_rank, reference))
    lines.append("")
    where = f"the config's layout ({config_path}: {_layout(own)})"
    if own.fits:
        lines.append(f"{where}: rank {result.own_rank} of {len(result.rows)}, {own.estimate.step_s:,.0f} s per step")
    elif own.plan is not None:
        lines.append(f"{where}: does not fit: {own.problems[0]}")
    else:
        lines.append(f"{where}: refused: {own.problems[0]}")
    if shown and (own.fits or len(shown) > 1):
        best = shown[0]
        ref, what = (own, "the config's layout") if own.fits else (shown[-1], f"the rank-{len(shown)} layout")
        if best is not ref:
            lines += _why(best, ref, what)
        else:
            lines.append("the config's layout is the fastest the model finds")
        lines.append(f"the fastest as vapo-plan sees one config, its memory and step time in full: {rerun} "
                     + " ".join(overrides(best.cfg)))
    if result.critic is not None and result.rows:
        lines += critic_lines(result, top=top, rerun=rerun)
    if not result.rows:
        lines += no_layout_lines(result)
    return "\n".join(lines)


def _critic_note(cfg: Config) -> str:
    """Where the table's critic is: at each actor layout (critic.parallel null) or at critic.parallel's."""
    from vapo_megatron.config.layout import own_critic_layout

    if not own_critic_layout(cfg):
        return ("one layout for actor and critic: the trainer builds both on the same ranks with the same parallel.* "
                "settings (their optimizers stay as configured); the critic's own layouts (critic.parallel) are "
                "searched after the table")
    c = cfg.critic.parallel
    return (f"the actor's layouts, the critic at its configured critic.parallel (TP={c.tp} PP={c.pp} "
            f"VPP={c.vpp or '-'} EP={c.ep}) on the same GPUs (their optimizers stay as configured); the critic's other "
            "layouts are searched after the table")


def _critic_layout(row: Row, world: int) -> str:
    c = row.cfg.critic.parallel
    if c is None or c == row.cfg.parallel:
        p = row.cfg.parallel
        return f"the actor's (TP={p.tp} PP={p.pp} VPP={p.vpp or '-'} DP={world // (p.tp * p.pp)})"
    return f"TP={c.tp} PP={c.pp}" + (f" EP={c.ep}" if c.ep > 1 else "") + f" DP={world // (c.tp * c.pp)}"


def _follows(row: Row) -> bool:
    """Whether the row's critic is at the actor's layout."""
    return row.cfg.critic.parallel is None or row.cfg.critic.parallel == row.cfg.parallel


def _critic_seconds(row: Row | None) -> str:
    if row is None or not row.fits:
        return "does not fit"
    e = row.estimate
    return (f"values {e.critic_forward_s:,.1f} s, update {e.phases['critic_update'].seconds:,.1f} s, "
            f"step {e.step_s:,.0f} s")


def critic_lines(result: Search, *, top: int, rerun: str) -> list[str]:
    """The critic's own layouts (critic_search.py): the fastest pair, the critic's layouts beside its
    actor layout with their cost per phase, and its fastest beside the config's own actor layout."""
    from vapo_megatron.sizing.critic_search import critic_overrides, critic_state

    cs, world = result.critic, result.world
    lines = ["",
             f"the critic's own layout (critic.parallel: TP within one NVLink domain, PP, EP for a MoE critic, no VPP; "
             f"sequence parallelism on wherever TP > 1; or null, the actor's): {cs.candidates} per actor layout, tried "
             f"beside the {cs.paired} fastest actor layouts" + (" and the config's" if cs.with_own else "")
             + f": {cs.tried:,} pairs, {cs.refused:,} refused by the checks, {cs.too_big:,} do not fit, "
             f"{cs.tried - cs.refused - cs.too_big:,} fit",
             "  the critic's seconds are modelled from its FLOPs at the assumed MFU whatever its TP (a small model's "
             "lower efficiency at a high TP and TP traffic are not priced): its layout moves them through its "
             "pipeline bubble, its micro-batches per DP rank and its gradient sync; memory is computed from shapes; "
             "nothing measured"]
    best = cs.best
    if best is None:
        return lines + ["  no critic layout fits beside these actor layouts"]
    actor = next(a for a, rows in cs.pairs if best in rows)
    follow = next(r for r in cs.rows_for(actor) if _follows(r))
    rank = result.rows.index(actor) + 1
    against = ("the critic's fastest layout here is the actor's" if best is follow else
               f"{best.estimate.step_s - follow.estimate.step_s:+,.1f} s against the critic at the actor's layout"
               if follow.fits else "the critic at the actor's layout does not fit" if follow.plan is not None
               else f"the critic at the actor's layout is refused: {follow.problems[0]}")
    lines.append(f"the fastest pair: actor {_layout(actor)} (rank {rank}) + critic {_critic_layout(best, world)}: "
                 f"{best.estimate.step_s:,.0f} s per step ({against})")
    lines.append("the critic's layouts beside that actor layout, fastest first (GiB per GPU at the worst rank: "
                 "training and rollout peaks, free, the critic's state; seconds: its values (of the score phase), "
                 "its update, the step):")
    lines.append(f"  {'critic layout':<40} {'train':>6} {'roll':>6} {'free':>5} {'critic':>6} {'values':>7} "
                 f"{'update':>7} {'step s':>7}")
    rows = cs.rows_for(actor)
    for r in rows[:top]:
        label = f"  {_critic_layout(r, world):<40}"
        if r.fits:
            e = r.estimate
            lines.append(f"{label} {gib(r.training_peak):6.1f} {gib(r.rollout_peak):6.1f} {gib(r.headroom):5.1f} "
                         f"{gib(critic_state(r)):6.1f} {e.critic_forward_s:7.1f} "
                         f"{e.phases['critic_update'].seconds:7.1f} {e.step_s:7.1f}")
        else:
            lines.append(f"{label} {'does not fit' if r.plan is not None else 'refused'}: {r.problems[0]}")
    if len(rows) > top:
        lines.append(f"  ... {len(rows) - top} more (--top)")
    own = cs.rows_for(result.own)
    if own is not None and result.own is not actor:
        fastest = next(r for r in own if r.fits)  # the config's own row fits: one does
        lines.append(f"beside the config's layout ({_layout(result.own)}): the critic's fastest "
                     f"{_critic_layout(fastest, world)}: {_critic_seconds(fastest)} (the critic at the actor's layout: "
                     f"{_critic_seconds(next(r for r in own if _follows(r)))})")
    lines.append(f"the fastest pair as vapo-plan sees one config: {rerun} "
                 + " ".join([*overrides(best.cfg), *critic_overrides(best.cfg)]))
    return lines


def no_layout_lines(result: Search) -> list[str]:
    """Why no layout is listed. Every layout refused by the checks (exit 2): the rules they break, each
    with the number of layouts it refused, and the three closest with all their problems; else (exit 1)
    the three that came closest to fitting in memory, and the checks' refusals by rule, if any."""
    lines = []
    if result.nothing_accepted:
        lines.append(f"no layout passes the checks: each of the {result.tried:,} tried on these {result.world} GPUs "
                     "breaks a rule of the trainer's, so none reached the memory check (exit 2: the config's other "
                     "settings and this number of GPUs do not go together)")
    else:
        lines.append("no layout fits; the closest (more GPUs, a GPU with more memory or another "
                     f"{engine_key(result.own.cfg, 'mem_fraction')}, as an override, may make one fit):")
        lines += [f"  {_layout(r)}: {r.problems[0]}" for r in result.closest]
    if result.refusals:
        lines.append(f"refused by the checks: {result.refused:,} layout(s), by rule (numbers in braces: the values "
                     "met at that place; a layout can break more than one rule):")
        lines += [f"  {c.layouts:>5,}  {c.text()}" for c in refusal_causes(result.refusals)]
    if result.nothing_accepted:
        lines.append("the closest refused (the fewest problems, then the fewest settings changed from the config's "
                     "own): change the setting named (an override) or the number of GPUs:")
        lines += [f"  {_layout(r)}: refused: {'; '.join(r.problems)}" for r in closest_refused(result)]
    return lines


__all__ = ["critic_lines", "format_search", "no_layout_lines"]
