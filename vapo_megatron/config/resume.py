"""A run directory remembers its configuration: run_dir/config.yaml, the resolved settings of the
latest start (every key, defaults included, but those the run has no use for: load.run_record;
`vapo-train --config run_dir/config.yaml` repeats it).

When the run directory holds a checkpoint to resume from, the new configuration is compared
with the saved one first. Settings in MAY_CHANGE_ON_RESUME pass (and are listed); any other
difference stops the start-up (exit 2) listing every differing key with both values, unless
trainer.allow_config_change=true, which lists the differences and goes on. A resumed run is
then the run its checkpoint came from, not a new one under the old one's name (a changed seed
used to resume silently and report the old seed's figures).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from vapo_megatron.config.load import flatten, parse_recorded, run_record, to_dict
from vapo_megatron.config.schema import Config, ConfigError, problems_error
from vapo_megatron.runtime.atomic import write_atomic

CONFIG_FILE = "config.yaml"

# Settings a resume may change, by group and why. Everything else (seeds, learning rates and
# schedules, algorithm, data, reward, model, rollout sampling, batch sizes, SFT) shapes what the
# resumed steps compute or what the checkpoint holds, and is refused.
MAY_CHANGE_ON_RESUME: dict[str, tuple[tuple[str, ...], str]] = {
    "length and cadence": (
        ("trainer.total_steps", "trainer.save_every", "trainer.deadline", "trainer.deadline_margin_s",
         "eval.every", "eval.n_samples", "eval.temperature", "eval.max_prompts"),
        "when the run stops, checkpoints and evaluates, and how it measures; no step computes differently "
        "(except a learning rate that decays over the run's length: then total_steps is refused)",
    ),
    "logging and outputs": (
        ("trainer.tensorboard", "trainer.export_hf", "trainer.wandb.mode", "trainer.wandb.project",
         "trainer.wandb.entity", "trainer.wandb.name", "trainer.wandb.tags"),
        "what is written besides the checkpoints, and where it is tracked",
    ),
    "guards": (
        ("trainer.max_consecutive_skips", "trainer.allow_config_change"),
        "when to give up, and this check itself",
    ),
    "layout": (
        ("parallel.tp", "parallel.pp", "parallel.vpp", "parallel.sequence_parallel",
         "critic.parallel.tp", "critic.parallel.pp", "critic.parallel.vpp", "critic.parallel.sequence_parallel"),
        "dist checkpoints load at any TP/PP layout (checkpoint/manager.py; the distributed optimizer's state "
        "with torch's Adam, where neither TE nor Apex imports, only at its own: the load says so); a new world "
        "size only loses the bitwise RNG continuation, and the resume says so",
    ),
    "memory and transport": (
        ("trainer.micro_batch_tokens", "trainer.logprob_chunk_tokens", "model.recompute_activations",
         "rollout.weight_sync_bucket_mb",
         "rollout.sglang.mem_fraction", "rollout.sglang.max_total_tokens", "rollout.sglang_http.urls",
         "rollout.wait_timeout_s", "trainer.offload_during_rollout"),
        "losses are sums over micro-batches and recomputation is exact, and the offload copies "
        "bytes, so these change memory and speed, not results; server addresses change between allocations",
    ),
    "location": (
        ("trainer.run_dir",),
        "the run directory itself may be moved or reached by another path",
    ),
}
_MAY_CHANGE = frozenset(k for keys, _ in MAY_CHANGE_ON_RESUME.values() for k in keys)
# Never, not even with trainer.allow_config_change, and why: the checkpoint holds a critic or it
# does not; megatron lays a mixture-of-experts model's optimizer state out by EP (one optimizer
# at EP=1, dense and expert optimizers chained, their keys prefixed, at EP > 1), so a load at
# another EP would ask for keys the checkpoint lacks. TP, PP and VPP may change (MAY_CHANGE_ON_RESUME).
NEVER_CHANGE = {
    "algo.estimator": "a run cannot switch its estimator (the checkpoint holds a critic or does not)",
    "parallel.ep": "a checkpoint cannot take another expert-parallel size "
                   "(megatron lays the optimizer state out by EP)",
    "critic.parallel.ep": "a critic checkpoint cannot take another expert-parallel size "
                          "(megatron lays the optimizer state out by EP)",
}


def ep_change(saved_config: dict | None, config: dict) -> str | None:
    """One line when a checkpoint's configuration (its state.json) has another parallel.ep than
    `config`, else None: the checkpoint manager's own check, for a run directory whose config.yaml
    was moved away (a checkpoint without one was written at EP=1)."""
    saved, now = ((c or {}).get("parallel", {}).get("ep", 1) for c in (saved_config, config))
    if saved == now:
        return None
    return f"written at parallel.ep={saved}, not {now}: {NEVER_CHANGE['parallel.ep']}; resume with parallel.ep={saved}"


def differences(saved: Config, new: Config) -> dict[str, tuple[object, object]]:
    """{dotted key: (saved value, new value)} for every setting that differs."""
    a, b = (flatten(_critic_layout_spelled_out(to_dict(c))) for c in (saved, new))
    return {k: (a[k], b[k]) for k in sorted(a) if a[k] != b[k]}


def _critic_layout_spelled_out(tree: dict) -> dict:
    """critic.parallel null is the actor's layout: compared as those values, so that a resume
    from null to an explicit layout (or back) is a change of the critic's layout fields only."""
    if "critic" in tree and tree["critic"].get("parallel", 0) is None:
        tree["critic"]["parallel"] = dict(tree["parallel"])
    return tree


def _has_checkpoint(run_dir: Path) -> bool:
    root = run_dir / "checkpoints"
    return root.is_dir() and any(p.is_dir() for p in root.glob("iter_*"))


def _describe(diffs: dict[str, tuple[object, object]]) -> list[str]:
    return [f"{k}: {old!r} in the run, {new!r} now" for k, (old, new) in diffs.items()]


def _run_length_schedules(cfg: Config) -> list[str]:
    """The LR schedules whose decay spans the run (lr_decay_steps null): a new run length moves
    them, so trainer.total_steps cannot change on a resume then."""
    return [f"{key}.lr_decay_style={o.lr_decay_style} with {key}.lr_decay_steps=null"
            for key, o in (("actor_optim", cfg.actor_optim), ("critic_optim", cfg.critic_optim))
            if o.lr_decay_style != "constant" and o.lr_decay_steps is None]


def check_resume(cfg: Config, *, announce: bool) -> None:
    """Compare `cfg` with run_dir/config.yaml when the run directory holds a checkpoint. Raises
    ConfigError listing every difference outside MAY_CHANGE_ON_RESUME (unless
    trainer.allow_config_change); `announce` (rank 0) prints the differences that pass."""
    run_dir = Path(cfg.trainer.run_dir)
    path = run_dir / CONFIG_FILE
    if not path.is_file() or not _has_checkpoint(run_dir):
        return
    # Missing keys take their defaults: a key added since the run started is not a change; a key
    # moved since (load.MOVED_KEYS) is read under its new name.
    saved, problems = parse_recorded(str(path))
    if problems:
        raise ConfigError(f"{path}: the saved configuration of the run cannot be read ({problems_error(problems)}); "
                          "move it away to resume without the check")
    diffs = differences(saved, cfg)
    for key, why in NEVER_CHANGE.items():
        if key in diffs:
            old, new = diffs[key]
            raise ConfigError(f"{key}: {old!r} in the run in {run_dir}, {new!r} now; {why}, not even with "
                              f"trainer.allow_config_change=true: resume with {key}={old}, "
                              "or choose a new trainer.run_dir")
    refused = {k: v for k, v in diffs.items() if k not in _MAY_CHANGE}
    why = ""
    if "trainer.total_steps" in diffs and (spans := _run_length_schedules(saved)):
        refused["trainer.total_steps"] = diffs["trainer.total_steps"]
        why = (f"\ntrainer.total_steps cannot change here: {' and '.join(spans)} decays the learning rate over the "
               "run's length, which a new total_steps would move (give lr_decay_steps a number to make it independent)")
    if refused and not cfg.trainer.allow_config_change:
        raise ConfigError(
            f"trainer.run_dir={run_dir} holds a run started with another configuration ({path}); "
            f"{len(refused)} setting(s) cannot change on a resume:\n"
            + "\n".join(f"  - {line}" for line in _describe(dict(sorted(refused.items()))))
            + why
            + "\nchoose a new trainer.run_dir, or set trainer.allow_config_change=true to resume with the new values"
        )
    if diffs and announce:
        note = " (trainer.allow_config_change=true)" if refused else ""
        print(f"[vapo] resuming {run_dir} with a changed configuration{note}: " + "; ".join(_describe(diffs)),
              flush=True)


def save(cfg: Config) -> Path:
    """Write run_dir/config.yaml atomically (rank 0, after check_resume passed)."""
    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = ("# The resolved configuration of the latest start of this run (vapo_megatron/config/resume.py).\n"
            + yaml.safe_dump(run_record(cfg), sort_keys=False))
    return write_atomic(run_dir / CONFIG_FILE, text)
