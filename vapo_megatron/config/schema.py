"""The run configuration's schema: typed, frozen sections, each key with exactly one default.

load.py reads YAML and overrides into these classes, checks.py and layout.py check the values,
preflight.py checks them against the launch and the files. Nothing downstream mutates a Config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


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
    # The learning-rate schedule counts this model's applied optimizer updates (a skipped NaN
    # step does not count), with megatron-core's OptimizerParamScheduler: linear warm-up from 0
    # to `lr` over `warmup_steps` updates, then `lr` held ("constant") or decayed to `min_lr`
    # ("linear", "cosine") by update `lr_decay_steps` (null: the run's last update).
    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_decay_steps: int | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # Megatron's distributed optimizer shards optimizer state over DP (GPU/NCCL only).
    distributed_optimizer: bool = False


@dataclass(frozen=True)
class AlgoConfig:
    """VAPO's knobs; each ablation of the paper's table is one switch (docs/algorithm.md)."""

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
    # Seconds a rank may wait for other ranks' generation, engine start or engine weight update
    # (mcore/parallel.py, wait_group: CPU gloo groups; NCCL's own timeout stays 30 minutes for
    # tensor traffic). Size it to the longest rollout or eval of the job with room to spare: at
    # 32B one rollout takes 30-60 minutes (docs/slurm.md).
    wait_timeout_s: float = 14400.0


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
    # save_every and eval.every count iterations too. The paper's "steps" (5,000, Figure 1) are
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
    # Resume even though settings outside config/resume.py's MAY_CHANGE_ON_RESUME differ from the run's
    # saved run_dir/config.yaml (the differences are logged); otherwise such a resume exits 2.
    allow_config_change: bool = False
    # When the job must end (vapo_megatron/trainer/deadline.py): "slurm" (the Slurm job's end time, asked
    # at every step; none outside a Slurm job), "none", or an ISO-8601 time such as
    # "2026-11-23T10:00:00+00:00" (no zone: local time). Before each step the trainer checks that its
    # longest step so far + its longest checkpoint save + deadline_margin_s fit; if not, it saves
    # and exits for a requeue.
    deadline: str = "slurm"
    # Seconds kept free after that step and save: exit and requeue, and a step longer than any
    # measured so far (the first save of a job is not measured yet either).
    deadline_margin_s: float = 300.0
    # Colocated runs: move the actor's and critic's parameters, gradient buffers and optimizer
    # state into (pinned) host memory before each generation and back before scoring, so that the
    # SGLang engine's KV cache can use that GPU memory (rollout.sglang_mem_fraction; vapo-plan
    # sizes both ways). Byte-exact: results are bitwise those of a run without it. Needs the
    # state of all of a node's ranks in host memory (checked at start-up). docs/weight_sync.md.
    offload_during_rollout: bool = False


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
