"""Every check of a configuration's values that needs neither the launch nor the files' contents.

    config_problems(cfg) -> list[str]      one message per problem, naming the key(s)
    parse_time(text)                       an ISO-8601 time (trainer.deadline, squeue's end time)

The parallel layout's checks are layout.py's (one check for every command); preflight.py adds
what needs the launch or the disk. Pure Python.
"""

from __future__ import annotations

import os
from datetime import datetime

from vapo_megatron.config.engines import engine_problems
from vapo_megatron.config.estimators import ESTIMATORS, estimator_of, unknown_estimator
from vapo_megatron.config.schema import Config, OptimConfig


def parse_time(text: str) -> float | None:
    """An ISO-8601 time as seconds since the epoch (no zone: local time, as squeue prints it);
    None for Slurm's "no end" values (N/A, Unknown, NONE, UNLIMITED) and anything unparsable."""
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        return None


def _is_iso_time(text: str) -> bool:
    return parse_time(text) is not None


def _optim_problems(key: str, o: OptimConfig) -> list[str]:
    out = []
    if o.lr < 0:
        out.append(f"{key}.lr={o.lr} must be >= 0")
    if not 0 <= o.min_lr <= max(o.lr, 0):
        out.append(f"{key}.min_lr={o.min_lr} must be in [0, {key}.lr={o.lr}]")
    if o.warmup_steps < 0:
        out.append(f"{key}.warmup_steps={o.warmup_steps} must be >= 0")
    if o.lr_decay_steps is not None and o.lr_decay_steps <= o.warmup_steps:
        out.append(f"{key}.lr_decay_steps={o.lr_decay_steps} must be greater than {key}.warmup_steps={o.warmup_steps} "
                   "(or null: decay over the whole run)")
    if o.weight_decay < 0:
        out.append(f"{key}.weight_decay={o.weight_decay} must be >= 0")
    for name, beta in (("adam_beta1", o.adam_beta1), ("adam_beta2", o.adam_beta2)):
        if not 0 <= beta < 1:
            out.append(f"{key}.{name}={beta} must be in [0, 1)")
    if o.adam_eps <= 0:
        out.append(f"{key}.adam_eps={o.adam_eps} must be > 0")
    if o.clip_grad < 0:
        out.append(f"{key}.clip_grad={o.clip_grad} must be >= 0 (0 turns clipping off)")
    return out


# Settings that only a critic reads: with an estimator that needs no critic (config/estimators.py)
# each is refused when set away from its default, in one line, rather than silently ignored
# (docs/algorithm.md, baselines).
_DEFAULTS = Config()
CRITIC_ONLY: dict[str, str] = {
    "algo.lambda_critic": "the critic's GAE lambda",
    "algo.value_clip": "the value loss's clip",
    "algo.value_pretrain_ev_threshold": "value pretraining's stop",
    "algo.decoupled_gae": "GAE's lambda split",
    "algo.length_adaptive": "GAE's length-adaptive lambda",
    "algo.lambda_policy": "GAE's policy lambda",
    "algo.alpha": "GAE's length-adaptive alpha",
    "algo.gamma": "GAE's discount",
    "critic_optim": "the critic's optimizer",
    "critic": "the critic's own settings",
    "model.critic_hf_path": "the critic's trunk",
}


def unused_settings(cfg: Config) -> list[str]:
    """The settings this run has no use for, held at their defaults by the checks: with an
    estimator that needs no critic, the critic's (CRITIC_ONLY). A run's records leave them out (load.run_record)."""
    return [] if estimator_of(cfg).needs_critic else list(CRITIC_ONLY)


def _get(cfg: Config, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def estimator_problems(cfg: Config) -> list[str]:
    """Asked of the estimator's record (config/estimators.py): one without a critic refuses value
    pretraining and every critic-only setting changed from its default, one line each; a group
    smaller than the estimator's min_group (no advantage at all) is refused too, and so is a
    setting only other estimators read (their records' keys) changed from its default."""
    unknown = unknown_estimator(cfg.algo.estimator)
    if unknown:
        return [unknown]
    a, est = cfg.algo, estimator_of(cfg)
    out = []
    for key in ("grpo_std_eps", "batch_std_eps"):
        if getattr(a, key) <= 0:
            out.append(f"algo.{key}={getattr(a, key)} must be > 0")
    others = {k: e.name for e in ESTIMATORS.values() if e is not est for k in e.keys if k not in est.keys}
    for key, owner in sorted(others.items()):
        if key not in CRITIC_ONLY and _get(cfg, key) != _get(_DEFAULTS, key):
            out.append(f"{key} is set, but only algo.estimator={owner} reads it (this run's is {est.name}): remove it "
                       "from the config")
    if 1 <= cfg.rollout.n_samples < est.min_group:  # (< 1 is its own problem)
        out.append(f"rollout.n_samples={cfg.rollout.n_samples} with algo.estimator={est.name} trains nothing: a "
                   "response's advantage is its reward against its group's, and a group of one has nothing to compare "
                   f"with (every advantage is 0); set rollout.n_samples >= {est.min_group}, or algo.estimator=gae "
                   "(or batch: the whole batch as the baseline)")
    if est.needs_critic:
        return out
    if a.value_pretrain_steps > 0:
        out.append(f"algo.value_pretrain_steps={a.value_pretrain_steps} needs a critic, which "
                   f"algo.estimator={est.name} does not have: set algo.value_pretrain_steps=0")
    for key, what in CRITIC_ONLY.items():
        if _get(cfg, key) != _get(_DEFAULTS, key):
            out.append(f"{key} ({what}) is set, but algo.estimator={est.name} has no critic: remove it from the config")
    return out


def partial_problems(cfg: Config) -> list[str]:
    """rollout.partial.*: checked whether or not it is enabled (a resume may turn it on)."""
    p, r = cfg.rollout.partial, cfg.rollout
    out = []
    if p.round_tokens < 1:
        out.append(f"rollout.partial.round_tokens={p.round_tokens} must be >= 1")
    if p.max_decode_steps is not None and p.max_decode_steps < 1:
        out.append(f"rollout.partial.max_decode_steps={p.max_decode_steps} must be >= 1 (or null: no budget)")
    if p.spare_batches < 0:
        out.append(f"rollout.partial.spare_batches={p.spare_batches} must be >= 0")
    if p.max_staleness < 1:
        out.append(f"rollout.partial.max_staleness={p.max_staleness} must be >= 1 (0 would make every step wait "
                   "for all its responses: turn rollout.partial.enabled off instead)")
    if not p.is_cap >= 1:
        out.append(f"rollout.partial.is_cap={p.is_cap} must be >= 1 (the importance weight's upper bound)")
    # A group trains at most max_staleness steps after its first token (the step waits for it), and
    # (1 + spare_batches) x prompts_per_step groups are in flight: with more spare batches than
    # max_staleness, steps must train more than prompts_per_step groups to keep the bound (issue 55).
    if p.spare_batches > p.max_staleness >= 1:
        out.append(f"rollout.partial.spare_batches={p.spare_batches} must be <= rollout.partial.max_staleness="
                   f"{p.max_staleness}: a group trains at most max_staleness steps after its first token, so "
                   "more spare batches in flight than that make steps train more than rollout.prompts_per_step "
                   "groups (up to (1 + spare_batches) x prompts_per_step at once); raise "
                   "rollout.partial.max_staleness or lower rollout.partial.spare_batches")
    # A step of partial rollout makes no extra sampling rounds; it admits prompt batches until
    # (1 + spare_batches) x prompts_per_step groups are in flight, so it takes at most 1 + spare_batches
    # batches: max_sampling_rounds, a step's prompts at most in batches, holds when it is no fewer.
    if p.enabled and r.dynamic_sampling and p.spare_batches >= 0 and r.max_sampling_rounds < 1 + p.spare_batches:
        out.append(f"rollout.max_sampling_rounds={r.max_sampling_rounds} bounds a step's prompts at "
                   f"{r.max_sampling_rounds} x rollout.prompts_per_step, but with rollout.partial.enabled a step "
                   f"takes up to 1 + rollout.partial.spare_batches = {1 + p.spare_batches} batches of prompts (to "
                   f"fill the groups in flight): set rollout.max_sampling_rounds >= {1 + p.spare_batches} or "
                   f"rollout.partial.spare_batches <= {r.max_sampling_rounds - 1}")
    return out


def _demo_data_hint(cfg: Config) -> tuple[str, str] | None:
    """(DIR, the command that writes it) when the config reads the layout scripts/make_demo_data.py
    writes (DIR/model and DIR/train.jsonl, as the CPU configs do); None for any other layout."""
    d = os.path.dirname(os.path.normpath(cfg.model.hf_path)) if cfg.model.hf_path else ""
    if not d or os.path.basename(os.path.normpath(cfg.model.hf_path)) != "model" or [
            os.path.normpath(p) for p in cfg.data.train_files] != [os.path.join(d, "train.jsonl")]:
        return None
    make = f"`python scripts/make_demo_data.py --out {d}`"
    if d == os.path.join("runs", "demo", "data"):
        return d, f"written by `make demo`, which then trains the demo, or by {make}"
    return d, f"written by {make}, with --task chain for the chain task's configs"


def config_problems(cfg: Config, *, check_paths: bool = True) -> list[str]:
    """Every invalid value or combination of values, each message naming the key(s) and what is
    allowed. Also checks that the named files exist (cheap); preflight.py checks their contents."""
    a, r, t, d, s = cfg.algo, cfg.rollout, cfg.trainer, cfg.data, cfg.sft
    out: list[str] = []

    def require(cond: bool, msg: str) -> None:
        if not cond:
            out.append(msg)

    for key, value in [("algo.gamma", a.gamma), ("algo.lambda_critic", a.lambda_critic),
                       ("algo.lambda_policy", a.lambda_policy)]:
        require(0.0 <= value <= 1.0, f"{key}={value} must be in [0, 1]")
    require(a.alpha > 0, f"algo.alpha={a.alpha} must be > 0")
    require(cfg.model.moe_aux_loss_coeff >= 0, f"model.moe_aux_loss_coeff={cfg.model.moe_aux_loss_coeff} must be >= 0")
    require(0 <= a.eps_low < 1, f"algo.eps_low={a.eps_low} must be in [0, 1)")
    require(a.eps_high >= 0, f"algo.eps_high={a.eps_high} must be >= 0")
    require(a.dual_clip_c is None or a.dual_clip_c > 1.0, f"algo.dual_clip_c={a.dual_clip_c} must be > 1 (or null)")
    require(a.nll_coef >= 0, f"algo.nll_coef={a.nll_coef} must be >= 0")
    require(a.value_clip is None or a.value_clip > 0, f"algo.value_clip={a.value_clip} must be > 0 (or null)")
    require(a.value_pretrain_steps >= 0, f"algo.value_pretrain_steps={a.value_pretrain_steps} must be >= 0")
    require(cfg.critic.updates_per_step >= 1, f"critic.updates_per_step={cfg.critic.updates_per_step} must be >= 1")
    require(not (cfg.critic.warm_start and cfg.model.critic_hf_path),
            "critic.warm_start and model.critic_hf_path both say where the critic starts: set one (warm_start: a value "
            "model with its head; critic_hf_path: a trunk whose head may start fresh)")
    require(a.value_pretrain_ev_threshold is None or a.value_pretrain_ev_threshold <= 1,
            f"algo.value_pretrain_ev_threshold={a.value_pretrain_ev_threshold} must be <= 1 (or null)")
    out += estimator_problems(cfg)
    require(not (r.dynamic_sampling and r.n_samples == 1),
            "rollout.dynamic_sampling=true with rollout.n_samples=1 drops every group (a group of one response is "
            "never informative) and generates rollout.max_sampling_rounds rounds every step: set "
            "rollout.n_samples >= 2, or rollout.dynamic_sampling=false")
    require(r.max_sampling_rounds >= 1, f"rollout.max_sampling_rounds={r.max_sampling_rounds} must be >= 1")
    out += partial_problems(cfg)
    require(cfg.reward.overlong_buffer >= 0,
            f"reward.overlong_buffer={cfg.reward.overlong_buffer} must be >= 0 (0: off)")
    require(cfg.reward.overlong_buffer <= r.max_new_tokens,
            f"reward.overlong_buffer={cfg.reward.overlong_buffer} must be <= rollout.max_new_tokens={r.max_new_tokens}")
    require(cfg.reward.overlong_penalty >= 0, f"reward.overlong_penalty={cfg.reward.overlong_penalty} must be >= 0")
    require(a.ppo_epochs >= 1, f"algo.ppo_epochs={a.ppo_epochs} must be >= 1")
    require(a.mini_batches >= 1, f"algo.mini_batches={a.mini_batches} must be >= 1")
    require(r.prompts_per_step >= 1, f"rollout.prompts_per_step={r.prompts_per_step} must be >= 1")
    require(r.n_samples >= 1, f"rollout.n_samples={r.n_samples} must be >= 1")
    require(a.mini_batches < 1 or r.prompts_per_step % a.mini_batches == 0,
            f"rollout.prompts_per_step={r.prompts_per_step} is not divisible by algo.mini_batches={a.mini_batches} "
            "(mini-batches keep each prompt's group together)")
    require(r.temperature > 0, f"rollout.temperature={r.temperature} must be > 0")
    require(0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]")
    require(r.top_k == -1 or r.top_k >= 1, f"rollout.top_k={r.top_k} must be -1 (off) or >= 1")
    require(r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1")
    require(r.weight_sync_bucket_mb >= 1, f"rollout.weight_sync_bucket_mb={r.weight_sync_bucket_mb} must be >= 1")
    require(r.wait_timeout_s > 0, f"rollout.wait_timeout_s={r.wait_timeout_s} must be > 0 (seconds a rank waits "
            "for another rank's generation, engine start or weight update)")
    out += engine_problems(cfg)
    require(d.max_prompt_tokens >= 1, f"data.max_prompt_tokens={d.max_prompt_tokens} must be >= 1")
    require(cfg.eval.every >= 0, f"eval.every={cfg.eval.every} must be >= 0 (0: no periodic evaluation)")
    for key, value in [("eval.max_prompts", cfg.eval.max_prompts), ("eval.n_samples", cfg.eval.n_samples)]:
        require(value >= 1, f"{key}={value} must be >= 1")
    require(cfg.eval.temperature is None or cfg.eval.temperature > 0,
            f"eval.temperature={cfg.eval.temperature} must be > 0 (or null)")
    require(t.micro_batch_tokens >= d.max_prompt_tokens + r.max_new_tokens,
            f"trainer.micro_batch_tokens={t.micro_batch_tokens} must hold one full sequence: "
            f"data.max_prompt_tokens + rollout.max_new_tokens = {d.max_prompt_tokens + r.max_new_tokens}")
    require(t.logprob_chunk_tokens >= 1, f"trainer.logprob_chunk_tokens={t.logprob_chunk_tokens} must be >= 1")
    require(t.total_steps >= 0, f"trainer.total_steps={t.total_steps} must be >= 0")
    require(t.save_every >= 1, f"trainer.save_every={t.save_every} must be >= 1")
    require(t.max_consecutive_skips >= 1, f"trainer.max_consecutive_skips={t.max_consecutive_skips} must be >= 1")
    require(bool(t.run_dir), "trainer.run_dir must name a directory")
    require(t.deadline in ("slurm", "none") or _is_iso_time(t.deadline),
            f"trainer.deadline={t.deadline!r} must be 'slurm', 'none' or an ISO-8601 time such as "
            "2026-11-23T10:00:00+00:00")
    require(t.deadline_margin_s >= 0, f"trainer.deadline_margin_s={t.deadline_margin_s} must be >= 0")
    # W&B refuses such runs at start-up, far from the config (its limits: a tag 1-64 characters).
    bad_tags = [tag for tag in t.wandb.tags if not 1 <= len(tag) <= 64]
    require(not bad_tags, f"trainer.wandb.tags: {bad_tags} must be 1 to 64 characters each (W&B's limit)")
    require(t.wandb.mode == "disabled" or bool(t.wandb.project.strip()), "trainer.wandb.project must name a project")
    out += _optim_problems("actor_optim", cfg.actor_optim)
    out += _optim_problems("critic_optim", cfg.critic_optim)
    require(bool(cfg.model.hf_path), "model.hf_path must name a Hugging Face model directory")
    demo = _demo_data_hint(cfg) if check_paths else None
    for key, paths in [("model.hf_path", [cfg.model.hf_path] if cfg.model.hf_path else []),
                       ("model.critic_hf_path", [cfg.model.critic_hf_path] if cfg.model.critic_hf_path else []),
                       ("data.train_files", d.train_files), ("data.eval_files", d.eval_files),
                       ("sft.files", s.files if s.steps > 0 else ())]:  # not read without SFT steps
        for p in paths if check_paths else []:
            require(os.path.exists(p), f"{key}: {p} does not exist")
            if demo and not os.path.exists(p) and os.path.dirname(os.path.normpath(p)) == demo[0]:
                out[-1] += f" ({demo[1]})"  # once, on the first missing file of that directory
                demo = None
    require(len(d.train_files) > 0 or t.total_steps == 0,
            "data.train_files is empty (needed when trainer.total_steps > 0)")
    require(s.steps >= 0, f"sft.steps={s.steps} must be >= 0")
    require(s.steps == 0 or len(s.files) > 0, f"sft.steps={s.steps} needs sft.files")
    require(s.batch_size >= 1, f"sft.batch_size={s.batch_size} must be >= 1")
    require(s.lr >= 0, f"sft.lr={s.lr} must be >= 0")
    require(s.target_accuracy is None or 0 < s.target_accuracy <= 1,
            f"sft.target_accuracy={s.target_accuracy} must be in (0, 1] (or null)")
    require(s.eval_every >= 1, f"sft.eval_every={s.eval_every} must be >= 1")
    require(s.eval_prompts >= 1, f"sft.eval_prompts={s.eval_prompts} must be >= 1")
    require(cfg.reward.fn in ("math", "exact") or cfg.reward.fn.count(":") == 1,
            f"reward.fn={cfg.reward.fn!r} must be 'math', 'exact' or 'package.module:function'")
    require(cfg.reward.timeout_s > 0, f"reward.timeout_s={cfg.reward.timeout_s} must be > 0")
    require(cfg.reward.correct_score > cfg.reward.incorrect_score,
            f"reward.correct_score={cfg.reward.correct_score} must be greater than "
            f"reward.incorrect_score={cfg.reward.incorrect_score}")
    return out
