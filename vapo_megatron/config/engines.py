"""What each rollout engine is, as a record the whole package asks (rollout.engine).

Every question about the engine -- does it share the trainer's GPUs (vapo-plan sizes it, the
trainer releases it around training and checks its share at start-up), does it need CUDA GPUs,
where are its settings -- is asked of its record, never of the engine's name. How an engine is
built and what GPU memory it takes are rollout/engines.py's (RECORDS, keyed by the same names; the
suite checks that the two tables agree). rollout.engine is any record's name (an unknown one: one
line naming the key, before torch). Pure Python: the config checks run before torch is imported.

Each engine's settings are a section of their own, rollout.<section> (config/schema.py), which
only that engine reads. A colocated engine's section has `tp` (GPUs per engine, dividing
parallel.tp) and `mem_fraction` (its static share of each GPU); a remote engine's has `urls`.

Adding an engine: its row here (and its section's value checks), its section in config/schema.py,
its builder and memory in rollout/engines.py, its module in rollout/.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from vapo_megatron.config.schema import Config, ConfigError

KEY = "rollout.engine"


def _no_section(cfg: Config) -> list[str]:
    return []


def _sglang_section(cfg: Config) -> list[str]:
    s, out = cfg.rollout.sglang, []
    if s.tp < 1:
        out.append(f"rollout.sglang.tp={s.tp} must be >= 1")
    if not 0 < s.mem_fraction < 1:
        out.append(f"rollout.sglang.mem_fraction={s.mem_fraction} must be in (0, 1)")
    if s.max_total_tokens is not None and s.max_total_tokens < 1:
        out.append(f"rollout.sglang.max_total_tokens={s.max_total_tokens} must be >= 1 (or null)")
    return out


@dataclass(frozen=True)
class Engine:
    name: str            # rollout.engine's value
    section: str | None  # its settings: rollout.<section> (config/schema.py); None: it has none
    # On the trainer's own GPUs, one engine per `tp` ranks of every TP group, with a static share of
    # each GPU: vapo-plan sizes it, the trainer releases it around training (and offloads its own
    # state for it with trainer.offload_during_rollout), the step-time model times it.
    colocated: bool
    needs_gpu: bool      # needs CUDA GPUs in the trainer's processes (refused at start-up without)
    remote: bool         # servers started elsewhere, reached over HTTP at its section's urls
    runtime: str         # the library whose model code generates: its version's limits apply (config/preflight.py)
    label: str           # its name in messages and vapo-plan's report
    summary: str         # one line, for messages and docs
    cpu_env: str | None = None  # set to 1, this environment variable runs it on a CPU instead (needs_gpu aside)
    # Its section's own value checks, run whatever engine is chosen (as every other key's).
    section_problems: Callable[[Config], list[str]] = _no_section


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("embedded", section=None, colocated=False, needs_gpu=False, remote=False, runtime="transformers",
           label="embedded",
           summary="transformers in the trainer's process, on each replica's first rank (CPU, tests)"),
    Engine("sglang", section="sglang", colocated=True, needs_gpu=True, remote=False, runtime="sglang", label="SGLang",
           summary="SGLang engines colocated on the trainer's GPUs, fed the actor's weights after every update",
           cpu_env="SGLANG_USE_CPU_ENGINE", section_problems=_sglang_section),
    Engine("sglang_http", section="sglang_http", colocated=False, needs_gpu=False, remote=True, runtime="sglang",
           label="SGLang server", summary="SGLang servers started elsewhere, one per DP rank, reached over HTTP"),
)}


def unknown_engine(name: str, key: str = KEY) -> str | None:
    """The config problem of an engine name no record has (naming `key`), else None."""
    if name in ENGINES:
        return None
    return f"{key}={name!r} is not an engine; one of: {', '.join(ENGINES)} (config/engines.py)"


def engine_named(name: str, key: str = KEY) -> Engine:
    """The record of engine `name`; a ConfigError naming `key` for a name no record has."""
    problem = unknown_engine(name, key)
    if problem:
        raise ConfigError(problem)
    return ENGINES[name]


def engine_of(cfg: Config) -> Engine:
    """The record of cfg.rollout.engine (config_problems says first when it has none: the checks
    that follow it ask known_engine)."""
    return engine_named(cfg.rollout.engine)


def known_engine(cfg: Config) -> Engine | None:
    """The record of cfg.rollout.engine, None for an unknown name (engine_problems reports it)."""
    return ENGINES.get(cfg.rollout.engine)


def engine_settings(cfg: Config):
    """The chosen engine's section (config/schema.py), None for an engine without one."""
    e = engine_of(cfg)
    return None if e.section is None else getattr(cfg.rollout, e.section)


def engine_key(cfg: Config, name: str) -> str:
    """The dotted key of setting `name` of the chosen engine's section: rollout.sglang.tp."""
    return f"rollout.{engine_of(cfg).section}.{name}"


def engine_tp(cfg: Config) -> int | None:
    """GPUs per engine of a colocated engine (its section's tp); None for the others."""
    return engine_settings(cfg).tp if engine_of(cfg).colocated else None


def with_engine_tp(cfg: Config, tp: int) -> Config:
    """`cfg` with its colocated engine's tp replaced (vapo-plan --search's candidates)."""
    section = engine_of(cfg).section
    return replace(cfg, rollout=replace(cfg.rollout, **{section: replace(getattr(cfg.rollout, section), tp=tp)}))


def colocated_engines() -> list[str]:
    return [e.name for e in ENGINES.values() if e.colocated]


def engine_problems(cfg: Config) -> list[str]:
    """Every engine section's own values, then what the chosen engine needs of the rest of the config."""
    out = [p for e in ENGINES.values() for p in e.section_problems(cfg)]
    if unknown := unknown_engine(cfg.rollout.engine):
        return out + [unknown]
    e, tp = engine_of(cfg), engine_tp(cfg)
    if e.colocated and tp >= 1 and cfg.parallel.tp % tp:
        out.append(f"{engine_key(cfg, 'tp')}={tp} must divide parallel.tp={cfg.parallel.tp} with {KEY}={e.name} "
                   "(each colocated engine lives on consecutive GPUs of one trainer TP group)")
    if e.remote and not engine_settings(cfg).urls:
        out.append(f"{KEY}={e.name} needs {engine_key(cfg, 'urls')}")
    return out


__all__ = ["ENGINES", "Engine", "colocated_engines", "engine_key", "engine_named", "engine_of", "engine_problems",
           "engine_settings", "engine_tp", "known_engine", "unknown_engine", "with_engine_tp"]
