"""Typed run configuration: YAML file + dotted command-line overrides, validated once.

    cfg = load_config("configs/demo_cpu.yaml", ["trainer.total_steps=5", "algo.nll_coef=0"])

Every key has exactly one default, here. Unknown keys, wrong types and impossible values are
refused at start-up with a message naming the key (``ConfigError``), before any model is
built. The returned object is frozen: nothing downstream mutates it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """An invalid setting; the message names the key and what is allowed."""


@dataclass(frozen=True)
class ModelConfig:
    # A Hugging Face model directory (config.json, safetensors, tokenizer) to start from.
    hf_path: str = ""
    # Parameter dtype in the trainer: float32 (CPU, tests) or bfloat16 (GPU).
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Critic trunk: a separate HF dir (e.g. a reward model) or "" to start from the policy's
    # trunk with a fresh value head (VAPO sec. 3.1 / component 1); with a warm start (sft.steps
    # > 0), from the warm-started policy.
    critic_hf_path: str = ""
    # Full activation recomputation in actor and critic: each layer keeps only its input for the
    # backward pass (memory for compute; vapo-plan shows the difference). Results are unchanged.
    recompute_activations: bool = False


@dataclass(frozen=True)
class ParallelConfig:
    # Actor and critic share one layout (they are colocated on the same ranks).
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    # Megatron's sequence parallelism: the [T, h] activations around norms, dropout and residuals
    # are split over TP along the sequence (activation memory of those / TP). Needs TP > 1; at
    # tp=1 there is nothing to split and it is off, as in Megatron-LM.
    sequence_parallel: bool = False


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # Megatron's distributed optimizer shards optimizer state over DP (GPU/NCCL only).
    distributed_optimizer: bool = False


@dataclass(frozen=True)
class AlgoConfig:
    """VAPO's knobs; each ablation of the paper's table is one switch (../shared/VAPO.md)."""

    gamma: float = 1.0
    # Component 2, decoupled GAE: lambda for the value targets (1.0 = Monte-Carlo returns).
    lambda_critic: float = 1.0
    # Fixed policy lambda when length_adaptive is off (paper's "without" setting: 0.95).
    lambda_policy: float = 0.95
    # Component 2 off ("shared lambda"): value targets use the policy's lambda too.
    decoupled_gae: bool = True
    # Component 3, length-adaptive GAE: lambda_i = 1 - 1/(alpha * |o_i|).
    length_adaptive: bool = True
    alpha: float = 0.05
    # Component 5, Clip-Higher.
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip_c: float | None = None
    # Component 4: "token" (every token weighs the same) or "sample" (per-response mean).
    loss_agg: Literal["token", "sample"] = "token"
    # Component 6, positive-example LM loss weight mu.
    nll_coef: float = 0.1
    value_clip: float | None = 0.5
    whiten_advantages: bool = False
    # Component 1, value pretraining: critic-only iterations before RL (0 disables). Each is a
    # full rollout iteration (trainer.total_steps' unit) with ppo_epochs x mini_batches critic
    # updates. A run of value pretraining alone is trainer.total_steps=0 (RL steps come after these).
    value_pretrain_steps: int = 50
    # Stop value pretraining early once explained variance reaches this (None: run all steps).
    value_pretrain_ev_threshold: float | None = None
    # Optimizer passes over each step's rollouts, each split into mini_batches updates.
    ppo_epochs: int = 1
    mini_batches: int = 1


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["embedded", "sglang", "sglang_http"] = "embedded"
    # Component 7, group sampling: prompts per step x samples per prompt.
    prompts_per_step: int = 512
    n_samples: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16384
    weight_sync_bucket_mb: int = 1024
    sglang_tp: int = 8
    sglang_mem_fraction: float = 0.7
    sglang_urls: tuple[str, ...] = ()


@dataclass(frozen=True)
class DataConfig:
    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()
    schema: Literal["auto", "simple", "dapo"] = "auto"
    apply_chat_template: bool = True
    max_prompt_tokens: int = 2048
    seed: int = 1234


@dataclass(frozen=True)
class RewardConfig:
    # "math" (math-verify), "exact" (string match) or a user function "package.module:function".
    fn: str = "math"
    correct_score: float = 1.0
    incorrect_score: float = -1.0
    timeout_s: float = 5.0


@dataclass(frozen=True)
class SFTConfig:
    """Optional warm start before RL: supervised steps on correct examples."""

    files: tuple[str, ...] = ()
    # At most this many steps; fewer when target_accuracy is reached first.
    steps: int = 0
    lr: float = 1e-4
    batch_size: int = 32
    # Stop once greedy accuracy on `eval_prompts` RL-train prompts (never the eval set)
    # reaches this; null: run all steps. Checked every `eval_every` steps.
    target_accuracy: float | None = None
    eval_every: int = 25
    eval_prompts: int = 256


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation on data.eval_files: before RL, every `every` RL steps, and at the end.
    Greedy accuracy (eval/accuracy) and K sampled responses per prompt (eval/avg@K, eval/pass@k,
    eval/maj@K; the paper reports AIME avg@32 at the training temperature). vapo-eval computes
    the same figures for a saved model (docs/evaluation.md)."""

    every: int = 10
    max_prompts: int = 512  # the first this many eval prompts
    n_samples: int = 1
    temperature: float | None = None  # null: rollout.temperature


@dataclass(frozen=True)
class TrainerConfig:
    # Checkpoints, metrics and the HF export. Under slurm/vapo_train.sbatch, when neither the file
    # nor an override sets it, the job's VAPO_RUN_DIR (runs/<job name>-<job id>) is used instead.
    run_dir: str = "runs/default"
    # Units (docs/slurm.md, "Steps and wall time"): a step is one rollout iteration (sample, score,
    # train); it makes algo.ppo_epochs x algo.mini_batches optimizer updates of each trained model.
    # total_steps counts VAPO iterations after the algo.value_pretrain_steps critic-only ones;
    # save_every and eval_every count iterations too. The paper's "steps" (5,000, Figure 1) are
    # optimizer updates: 5,000 / 16 mini-batches = 313 iterations.
    total_steps: int = 100
    # Token budget of one micro-batch (padded prompt+response tokens), for both models.
    micro_batch_tokens: int = 16384
    # Tokens per chunk of the actor's log-prob kernel: its one float32 work buffer is
    # [chunk, padded vocab / TP] (1024 x 152k = 0.6 GB at TP=1); vapo-plan counts it.
    logprob_chunk_tokens: int = 1024
    save_every: int = 50
    seed: int = 1234
    export_hf: bool = True
    deterministic: bool = False
    tensorboard: bool = True
    # A NaN/Inf loss or gradient norm skips that optimizer step (docs/faults.md); this many skips
    # in a row (per model; each mini-batch is one step) stop the run with an error.
    max_consecutive_skips: int = 10
    # Resume even though settings outside run_config.MAY_CHANGE_ON_RESUME differ from the run's
    # saved run_dir/config.yaml (the differences are logged); otherwise such a resume exits 2.
    allow_config_change: bool = False
    # When the job must end (vapo_megatron/deadline.py): "slurm" (the Slurm job's end time, asked
    # at every step; none outside a Slurm job), "none", or an ISO-8601 time such as
    # "2026-11-23T10:00:00+00:00" (no zone: local time). Before each step the trainer checks that its
    # longest step so far + its longest checkpoint save + deadline_margin_s fit; if not, it saves
    # and exits for a requeue.
    deadline: str = "slurm"
    # Seconds kept free after that step and save: exit and requeue, and a step longer than any
    # measured so far (the first save of a job is not measured yet either).
    deadline_margin_s: float = 300.0


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    actor_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-6))
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# ---- loading -----------------------------------------------------------------------------

MOVED_KEYS = {"trainer.eval_every": "eval.every", "data.eval_max_prompts": "eval.max_prompts"}

def _from_dict(cls, data: dict, path: str, errors: list[str]):
    """Build dataclass `cls` from a plain dict. Unknown keys and wrong types are appended to
    `errors` (all of them, not just the first); their fields keep the default."""
    if not isinstance(data, dict):
        errors.append(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
        return cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = f"{path}." if path else ""
    for name in sorted(set(data) - set(fields)):
        if f"{where}{name}" in MOVED_KEYS:
            errors.append(f"config key {where}{name} is now {MOVED_KEYS[f'{where}{name}']}")
        else:
            errors.append(f"unknown config key {where}{name} (allowed: {', '.join(sorted(fields))})")
    kwargs = {}
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    defaults = cls()
    for name, value in data.items():
        if name not in fields:
            continue
        key = f"{where}{name}"
        default = getattr(defaults, name)
        if dataclasses.is_dataclass(default):
            kwargs[name] = _from_dict(type(default), value or {}, key, errors)
            continue
        try:
            kwargs[name] = _coerce(value, default, hints[name], key)
        except ConfigError as e:
            errors.append(str(e))
    return cls(**kwargs)


def _coerce(value, default, hint: str, key: str):
    allowed = hint.split("Literal[", 1)[1].rsplit("]", 1)[0] if "Literal[" in hint else None
    if allowed is not None:
        options = [o.strip().strip("'\"") for o in allowed.split(",")]
        if value not in options:
            raise ConfigError(f"{key}={value!r} is not allowed (choose one of: {', '.join(options)})")
        return value
    if value is None:
        if "None" in hint:
            return None
        raise ConfigError(f"{key} may not be null")
    if isinstance(default, tuple) or hint.startswith("tuple"):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(str(v) for v in value)
    if "bool" in hint:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint.startswith("str"):
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    return value


def problems_error(problems: list[str]) -> ConfigError:
    """One ConfigError listing every problem (a user fixes them all in one go)."""
    if len(problems) == 1:
        return ConfigError(problems[0])
    return ConfigError(f"{len(problems)} invalid settings:\n" + "\n".join(f"  - {p}" for p in problems))


def load_config(path: str | None, overrides: list[str] = (), *, check: bool = True, check_paths: bool = True,
                fallbacks: dict[str, str] | None = None) -> Config:
    """Load a YAML file, apply `a.b.c=value` overrides (YAML-typed values), validate, freeze.

    Unknown keys and wrong types always raise (listing all of them). With check=False the
    value checks of `validate` are left to the caller (vapo-train runs them, together with
    the checks against the launch and the files, in preflight.validate_startup). check_paths=False
    skips the checks that model and data paths exist (vapo-plan sizes a run on a machine that has
    neither). `fallbacks` maps dotted keys to a launcher's values that apply only where neither the
    file nor an override sets the key (the Slurm job's run dir: the user's choice wins)."""
    data: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        with open(path) as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: invalid YAML: {e}") from None
    try:
        merged = OmegaConf.merge(OmegaConf.create(data), OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad command-line override: {e}") from None
    for key, value in (fallbacks or {}).items():
        if OmegaConf.select(merged, key) is None:
            OmegaConf.update(merged, key, value)
    errors: list[str] = []
    cfg = _from_dict(Config, OmegaConf.to_container(merged, resolve=True), "", errors)
    if errors:
        raise problems_error(errors)
    if check:
        validate(cfg, check_paths=check_paths)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


# ---- validation (everything checkable from the config alone) -----------------------------

def validate(cfg: Config, *, check_paths: bool = True) -> None:
    """Raise one ConfigError listing every problem found by `config_problems`."""
    problems = config_problems(cfg, check_paths=check_paths)
    if problems:
        raise problems_error(problems)


def _is_iso_time(text: str) -> bool:
    from vapo_megatron.deadline import parse_time

    return parse_time(text) is not None


def _optim_problems(key: str, o: OptimConfig) -> list[str]:
    out = []
    if o.lr < 0:
        out.append(f"{key}.lr={o.lr} must be >= 0")
    if not 0 <= o.min_lr <= max(o.lr, 0):
        out.append(f"{key}.min_lr={o.min_lr} must be in [0, {key}.lr={o.lr}]")
    if o.warmup_steps < 0:
        out.append(f"{key}.warmup_steps={o.warmup_steps} must be >= 0")
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


def config_problems(cfg: Config, *, check_paths: bool = True) -> list[str]:
    """Every invalid value or combination of values, each message naming the key(s) and what is
    allowed. Also checks that the named files exist (cheap); preflight.py checks their contents."""
    a, r, t, d, s = cfg.algo, cfg.rollout, cfg.trainer, cfg.data, cfg.sft
    out: list[str] = []

    def require(cond: bool, msg: str) -> None:
        if not cond:
            out.append(msg)

    for key, value in [("algo.gamma", a.gamma), ("algo.lambda_critic", a.lambda_critic), ("algo.lambda_policy", a.lambda_policy)]:
        require(0.0 <= value <= 1.0, f"{key}={value} must be in [0, 1]")
    require(a.alpha > 0, f"algo.alpha={a.alpha} must be > 0")
    require(0 <= a.eps_low < 1, f"algo.eps_low={a.eps_low} must be in [0, 1)")
    require(a.eps_high >= 0, f"algo.eps_high={a.eps_high} must be >= 0")
    require(a.dual_clip_c is None or a.dual_clip_c > 1.0, f"algo.dual_clip_c={a.dual_clip_c} must be > 1 (or null)")
    require(a.nll_coef >= 0, f"algo.nll_coef={a.nll_coef} must be >= 0")
    require(a.value_clip is None or a.value_clip > 0, f"algo.value_clip={a.value_clip} must be > 0 (or null)")
    require(a.value_pretrain_steps >= 0, f"algo.value_pretrain_steps={a.value_pretrain_steps} must be >= 0")
    require(a.value_pretrain_ev_threshold is None or a.value_pretrain_ev_threshold <= 1,
            f"algo.value_pretrain_ev_threshold={a.value_pretrain_ev_threshold} must be <= 1 (or null)")
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
    require(r.sglang_tp >= 1, f"rollout.sglang_tp={r.sglang_tp} must be >= 1")
    require(r.engine != "sglang" or r.sglang_tp < 1 or cfg.parallel.tp % r.sglang_tp == 0,
            f"rollout.sglang_tp={r.sglang_tp} must divide parallel.tp={cfg.parallel.tp} with rollout.engine=sglang "
            "(each colocated engine lives on consecutive GPUs of one trainer TP group)")
    require(0 < r.sglang_mem_fraction < 1, f"rollout.sglang_mem_fraction={r.sglang_mem_fraction} must be in (0, 1)")
    require(r.engine != "sglang_http" or len(r.sglang_urls) > 0, "rollout.engine=sglang_http needs rollout.sglang_urls")
    require(d.max_prompt_tokens >= 1, f"data.max_prompt_tokens={d.max_prompt_tokens} must be >= 1")
    for key, value in [("eval.every", cfg.eval.every), ("eval.max_prompts", cfg.eval.max_prompts), ("eval.n_samples", cfg.eval.n_samples)]:
        require(value >= 1, f"{key}={value} must be >= 1")
    require(cfg.eval.temperature is None or cfg.eval.temperature > 0, f"eval.temperature={cfg.eval.temperature} must be > 0 (or null)")
    require(t.micro_batch_tokens >= d.max_prompt_tokens + r.max_new_tokens,
            f"trainer.micro_batch_tokens={t.micro_batch_tokens} must hold one full sequence: "
            f"data.max_prompt_tokens + rollout.max_new_tokens = {d.max_prompt_tokens + r.max_new_tokens}")
    require(t.logprob_chunk_tokens >= 1, f"trainer.logprob_chunk_tokens={t.logprob_chunk_tokens} must be >= 1")
    require(t.total_steps >= 0, f"trainer.total_steps={t.total_steps} must be >= 0")
    require(t.save_every >= 1, f"trainer.save_every={t.save_every} must be >= 1")
    require(t.max_consecutive_skips >= 1, f"trainer.max_consecutive_skips={t.max_consecutive_skips} must be >= 1")
    require(bool(t.run_dir), "trainer.run_dir must name a directory")
    require(t.deadline in ("slurm", "none") or _is_iso_time(t.deadline),
            f"trainer.deadline={t.deadline!r} must be 'slurm', 'none' or an ISO-8601 time such as 2026-11-23T10:00:00+00:00")
    require(t.deadline_margin_s >= 0, f"trainer.deadline_margin_s={t.deadline_margin_s} must be >= 0")
    require(cfg.parallel.tp >= 1, f"parallel.tp={cfg.parallel.tp} must be >= 1")
    require(cfg.parallel.pp >= 1, f"parallel.pp={cfg.parallel.pp} must be >= 1")
    require(cfg.parallel.vpp is None or (cfg.parallel.vpp >= 1 and cfg.parallel.pp >= 2),
            f"parallel.vpp={cfg.parallel.vpp} must be null, or >= 1 with parallel.pp >= 2 (parallel.pp={cfg.parallel.pp})")
    out += _optim_problems("actor_optim", cfg.actor_optim)
    out += _optim_problems("critic_optim", cfg.critic_optim)
    require(bool(cfg.model.hf_path), "model.hf_path must name a Hugging Face model directory")
    for key, paths in [("model.hf_path", [cfg.model.hf_path] if cfg.model.hf_path else []),
                       ("model.critic_hf_path", [cfg.model.critic_hf_path] if cfg.model.critic_hf_path else []),
                       ("data.train_files", d.train_files), ("data.eval_files", d.eval_files), ("sft.files", s.files)]:
        for p in paths if check_paths else []:
            require(os.path.exists(p), f"{key}: {p} does not exist")
    require(len(d.train_files) > 0 or t.total_steps == 0, "data.train_files is empty (needed when trainer.total_steps > 0)")
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
            f"reward.correct_score={cfg.reward.correct_score} must be greater than reward.incorrect_score={cfg.reward.incorrect_score}")
    return out
