"""The run configuration's schema: typed, frozen sections, each key with exactly one default.

load.py reads YAML and overrides into these classes, checks.py and layout.py check the values,
preflight.py checks them against the launch and the files. Nothing downstream mutates a Config.
A problem is a ConfigError; problems_error makes one of every problem found (each check's answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """An invalid setting; the message names the key and what is allowed."""


def problems_error(problems: list[str]) -> ConfigError:
    """One ConfigError listing every problem (a user fixes them all in one go)."""
    if len(problems) == 1:
        return ConfigError(problems[0])
    return ConfigError(f"{len(problems)} invalid settings:\n" + "\n".join(f"  - {p}" for p in problems))


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
    # Mixture-of-experts models: weight of the router's load-balancing loss (megatron-core's
    # aux_loss, sequence-level mean) added to the actor's and critic's losses; 0 turns it off.
    # VAPO's recipe is dense; RL recipes for MoE keep it small (e.g. 0.001), or 0 to leave the
    # pretrained routing alone. Logged as actor/moe_aux_loss and critic/moe_aux_loss.
    moe_aux_loss_coeff: float = 0.0


@dataclass(frozen=True)
class ParallelConfig:
    # Actor and critic share one layout (they are colocated on the same ranks).
    tp: int = 1  # tensor parallel size (ranks per TP group)
    pp: int = 1  # pipeline parallel size (stages)
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved schedule; null: none)
    # Expert parallelism (mixture-of-experts models): the routed experts of each MoE layer are
    # split over `ep` data-parallel ranks, tokens travel to their experts by all-to-all
    # (megatron-core's expert_model_parallel_size; the experts' TP is parallel.tp). Divides the
    # data-parallel size and the number of experts; 1 for a dense model.
    ep: int = 1
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
    min_lr: float = 0.0  # the learning rate a decay ends at
    warmup_steps: int = 0  # updates of linear warm-up from 0 to lr
    # after warm-up: hold lr, or decay it to min_lr
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_decay_steps: int | None = None  # the update by which the decay reaches min_lr (null: the run's last)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    adam_beta1: float = 0.9  # Adam's first-moment decay
    adam_beta2: float = 0.999  # Adam's second-moment decay
    adam_eps: float = 1e-8  # Adam's denominator epsilon
    clip_grad: float = 1.0  # global gradient-norm clip (0: none)
    # Megatron's distributed optimizer shards optimizer state over DP (GPU/NCCL only).
    distributed_optimizer: bool = False


@dataclass(frozen=True)
class AlgoConfig:
    """VAPO's knobs; each ablation of the paper's table is one switch (docs/algorithm.md)."""

    # How advantages are estimated (config/estimators.py). "gae": VAPO/PPO, a critic (value model)
    # is trained and GAE runs on its values. "grpo": value-free (GRPO, DAPO): a response's advantage
    # is its reward minus its group's mean reward, over the group's std. "batch": value-free, the
    # reward minus the mean of the step's whole batch (every DP rank), over its std (REINFORCE++'s
    # global normalization): defined at one answer per prompt. Without a critic there is none at
    # all (not built, not checkpointed, not in vapo-plan), and the critic-only settings are refused.
    estimator: str = "gae"  # a name of config/estimators.py's records: gae, grpo, batch (or one registered)
    # grpo: divide by the group's reward std (+ grpo_std_eps); false: the "Dr. GRPO" variant,
    # reward minus the group mean only.
    grpo_std_norm: bool = True
    grpo_std_eps: float = 1e-6  # grpo: added to the group's std before dividing
    batch_std_eps: float = 1e-6  # batch: added to the batch's std before dividing
    gamma: float = 1.0  # discount factor of GAE (1.0: undiscounted, as in the paper)
    # Component 2, decoupled GAE: lambda for the value targets (1.0 = Monte-Carlo returns).
    lambda_critic: float = 1.0
    # Fixed policy lambda when length_adaptive is off (paper's "without" setting: 0.95).
    lambda_policy: float = 0.95
    # Component 2 off ("shared lambda"): value targets use the policy's lambda too.
    decoupled_gae: bool = True
    # Component 3, length-adaptive GAE: lambda_i = 1 - 1/(alpha * |o_i|).
    length_adaptive: bool = True
    alpha: float = 0.05  # length-adaptive GAE's alpha
    # Component 5, Clip-Higher.
    eps_low: float = 0.2  # PPO's lower clip range
    eps_high: float = 0.28  # PPO's upper clip range (above eps_low: Clip-Higher)
    dual_clip_c: float | None = None  # dual-clip bound for negative advantages (null: off)
    # Component 4: "token" (every token weighs the same) or "sample" (per-response mean).
    loss_agg: Literal["token", "sample"] = "token"
    # Component 6, positive-example LM loss weight mu.
    nll_coef: float = 0.1
    value_clip: float | None = 0.5  # value-loss clip range around the old values (null: off)
    whiten_advantages: bool = False  # normalize advantages to mean 0, std 1 over the global batch
    # Component 1, value pretraining: critic-only iterations before RL (0 disables). Each is a
    # full rollout iteration (trainer.total_steps' unit) with ppo_epochs x mini_batches critic
    # updates. A run of value pretraining alone is trainer.total_steps=0 (RL steps come after these).
    value_pretrain_steps: int = 50
    # Stop value pretraining early once explained variance reaches this (None: run all steps).
    value_pretrain_ev_threshold: float | None = None
    # Optimizer passes over each step's rollouts, each split into mini_batches updates.
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer updates per epoch (each on 1/mini_batches of the step's rollouts)


@dataclass(frozen=True)
class PartialRolloutConfig:
    """Partial rollout (docs/training.md, "Partial rollout"): a step's generation is bounded and the
    responses it leaves unfinished are carried over, with their tokens, behaviour log-probs and
    weight versions, and continued with newer weights in a later step. Groups train only whole."""

    enabled: bool = False  # bounded generation per step, the carry-over buffer and the off-policy correction
    # Responses grow in rounds of at most this many new tokens each; after every round the step
    # stops generating once this DP rank's share of rollout.prompts_per_step whole groups has finished.
    round_tokens: int = 1024
    # The step's decode-step budget: after this many decode steps it stops as soon as every
    # mini-batch has a finished group (null: no budget, only the group count stops it).
    max_decode_steps: int | None = None
    # Prompt batches (of rollout.prompts_per_step) kept in flight beyond the step's own: their
    # unfinished responses are what carries over. The step starts by admitting batches until
    # (1 + spare_batches) x prompts_per_step groups are in flight. At most max_staleness: a group
    # trains within max_staleness steps of its first token, so more would make steps train more
    # than prompts_per_step groups.
    spare_batches: int = 1
    # A token generated by weights this many versions (actor updates: a value-pretraining step makes
    # none) older than the trained policy is the oldest a step may train on: the step waits for a
    # group that would exceed it at the next step.
    max_staleness: int = 1
    # Decoupled PPO: each stale token's loss is weighted by min(pi_prox / pi_behav, is_cap), the
    # truncated importance ratio of the recomputed old log-prob (proximal policy) to the engine's
    # log-prob when it sampled the token (behaviour policy).
    is_cap: float = 2.0


@dataclass(frozen=True)
class SGLangConfig:
    """rollout.engine=sglang: SGLang engines colocated on the trainer's GPUs, one per `tp` ranks of
    every trainer TP group, fed the actor's weights after every update (rollout/engines.py)."""

    tp: int = 8  # tensor parallel size of one SGLang engine (GPUs per engine)
    mem_fraction: float = 0.7  # share of GPU memory SGLang's KV cache may take
    # SGLang's max_total_tokens (colocated engines): at most this many tokens of KV cache, however
    # large the share above (null: what the share gives). SGLang's CPU engine takes its share of the
    # host's memory and refuses to start when free memory fell by more than the share while it
    # loaded (other processes decide that): a large share with a cap starts reliably there
    # (docs/what_ran_where.md).
    max_total_tokens: int | None = None


@dataclass(frozen=True)
class SGLangHttpConfig:
    """rollout.engine=sglang_http: SGLang servers started elsewhere, reached over HTTP. A section of
    its own, not rollout.sglang's: each engine reads its own section only, and a server's TP, memory
    share and cache cap are set where it was started (its TP is asked of it at start-up)."""

    urls: tuple[str, ...] = ()  # servers of engine sglang_http, one per engine


@dataclass(frozen=True)
class RolloutConfig:
    # The rollout engine, a name of config/engines.py's records: embedded (transformers, CPU), sglang
    # (colocated engines) or sglang_http (running servers). Its settings are its own section below.
    engine: str = "embedded"
    # Component 7, group sampling: prompts per step x samples per prompt.
    prompts_per_step: int = 512  # prompts sampled per step
    n_samples: int = 16  # responses per prompt (the group)
    temperature: float = 1.0  # sampling temperature (also the actor's log-prob temperature)
    top_p: float = 1.0  # nucleus sampling (1.0: off)
    top_k: int = -1  # top-k sampling (-1: off)
    max_new_tokens: int = 16384  # longest response, tokens
    weight_sync_bucket_mb: int = 1024  # size of one weight-sync bucket into the engines, MiB
    # Colocated SGLang engines (rollout.engine=sglang).
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    # SGLang servers over HTTP (rollout.engine=sglang_http).
    sglang_http: SGLangHttpConfig = field(default_factory=SGLangHttpConfig)
    # Dynamic sampling (DAPO sec. 3.2): groups whose samples are all correct or all wrong (equal
    # rewards: zero advantage under GRPO, little signal under PPO) are dropped, and further
    # prompts_per_step batches are generated until the step has prompts_per_step informative
    # groups or max_sampling_rounds rounds have run (then it trains on what it has; logged).
    dynamic_sampling: bool = False
    # Generation rounds of one step at most, with dynamic_sampling: a step's prompts are at most this
    # many times prompts_per_step. With rollout.partial a step makes no extra rounds; it takes at most
    # 1 + partial.spare_batches batches of prompts, which must not be more than this.
    max_sampling_rounds: int = 10
    # Routing replay (R3, mixture-of-experts models): the engine returns the experts it routed each
    # token to, and the actor's routers take them in every forward whose log-probs PPO uses (old
    # log-probs, updates, the recomputed forward); the critic routes with its own router. null: on
    # for a MoE model, off for a dense one (true is refused there). Logged: moe/routing_mismatch.
    routing_replay: bool | None = None
    # seconds a rank may wait, on a gloo group, for others' generation, engine start or weight update
    # (docs/slurm.md, Timeouts)
    wait_timeout_s: float = 14400.0
    # Partial rollout: no step waits for the longest answer (off by default).
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)


@dataclass(frozen=True)
class DataConfig:
    train_files: tuple[str, ...] = ()  # RL prompt files (JSONL or Parquet; docs/data_and_rewards.md)
    eval_files: tuple[str, ...] = ()  # held-out eval prompt files
    # row layout of the files: detected (auto), simple (prompt/answer) or dapo
    schema: Literal["auto", "simple", "dapo"] = "auto"
    apply_chat_template: bool = True  # wrap prompts in the tokenizer's chat template
    max_prompt_tokens: int = 2048  # longer prompts are skipped (counted in data/*_skipped)
    seed: int = 1234  # seed of the prompt order


@dataclass(frozen=True)
class RewardConfig:
    # "math" (math-verify), "exact" (string match) or a user function "package.module:function".
    fn: str = "math"
    correct_score: float = 1.0  # reward of a correct response
    incorrect_score: float = -1.0  # reward of an incorrect one
    timeout_s: float = 5.0  # time limit of one reward call, seconds (over it: incorrect)
    # Overlong reward shaping (DAPO sec. 3.4): a response longer than rollout.max_new_tokens -
    # overlong_buffer tokens loses up to overlong_penalty, linearly, reaching all of it at
    # rollout.max_new_tokens (a truncated response). 0 tokens: off.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # the penalty at rollout.max_new_tokens (with overlong_buffer > 0)


@dataclass(frozen=True)
class SFTConfig:
    """Optional warm start before RL: supervised steps on correct examples."""

    files: tuple[str, ...] = ()  # supervised examples (prompt + correct response)
    # At most this many steps; fewer when target_accuracy is reached first.
    steps: int = 0
    lr: float = 1e-4  # the warm start's learning rate
    batch_size: int = 32  # examples per step
    # Stop once greedy accuracy on `eval_prompts` RL-train prompts (never the eval set)
    # reaches this; null: run all steps. Checked every `eval_every` steps.
    target_accuracy: float | None = None
    eval_every: int = 25  # steps between target_accuracy checks
    eval_prompts: int = 256  # RL-train prompts of each target_accuracy check


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation on data.eval_files: before RL, every `every` RL steps, and at the end.
    Greedy accuracy (eval/accuracy) and K sampled responses per prompt (eval/avg@K, eval/pass@k,
    eval/maj@K; the paper reports AIME avg@32 at the training temperature). vapo-eval computes
    the same figures for a saved model (docs/evaluation.md)."""

    every: int = 10  # RL steps between evals (0: none between the one before RL and the final one)
    max_prompts: int = 512  # the first this many eval prompts
    n_samples: int = 1  # K: sampled responses per prompt (avg@K, pass@k, maj@K)
    temperature: float | None = None  # null: rollout.temperature


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases tracking (off by default): the metrics of metrics.jsonl under the same names
    and steps, and the resolved configuration as the W&B run's config. Rank 0 only. The run id is
    kept in run_dir/wandb_id, so a resumed or requeued job continues the same W&B run; needs the
    wandb package (pip install '.[wandb]'), else one warning and the run goes on (README)."""

    # "disabled", "offline" (records under run_dir/wandb; upload later with `wandb sync`) or
    # "online" (needs WANDB_API_KEY or `wandb login`; when the server cannot be reached the run
    # logs offline instead, with one warning).
    mode: Literal["disabled", "offline", "online"] = "disabled"
    project: str = "vapo-megatron"  # the W&B project
    entity: str = ""  # the W&B team or user ("": the account's default entity)
    name: str = ""  # the run's display name ("": the run directory's name)
    tags: tuple[str, ...] = ()  # the run's tags (1-64 characters each)


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
    save_every: int = 50  # steps between checkpoints (and at the end, and on a stop)
    seed: int = 1234  # seed of initialization and rollout sampling
    export_hf: bool = True  # write the final actor as an HF model directory (run_dir/hf)
    # torch's deterministic algorithms and megatron's deterministic_mode; sets CUBLAS_WORKSPACE_CONFIG
    # and NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 before CUDA starts (slower)
    deterministic: bool = False
    tensorboard: bool = True  # TensorBoard event files in run_dir/tensorboard
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
    # Colocated runs: the actor's and critic's parameters, gradient buffers and optimizer state go
    # to (pinned) host memory before each generation and come back before scoring, so the SGLang
    # KV cache can use that GPU memory; bitwise the same results; host memory checked at start-up.
    # Move the trainer's state to host memory while the engines generate (docs/weight_sync.md).
    offload_during_rollout: bool = False
    # Weights & Biases (off by default).
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(frozen=True)
class CriticConfig:
    """The value model's own settings, beside its optimizer (critic_optim) and trunk
    (model.critic_hf_path); refused with an estimator that has no critic."""

    # K: critic passes per RL step. The critic's update (algo.ppo_epochs x algo.mini_batches
    # steps over the step's rollouts) runs K times before the actor's, on the same returns: a
    # critic that lags the policy catches up without more rollouts (NeMo-RL's critic_ppo_epochs;
    # the SAO recipe, arXiv 2607.07508, uses K=2). The actor's update does not depend on it (its
    # advantages come from the values scored before any update). Value pretraining steps keep one.
    updates_per_step: int = 1
    # A value model to start the critic from, instead of the policy's trunk with a fresh value head:
    # an HF <Family>ForTokenClassification directory (num_labels=1; its `score` is the value head),
    # or a Megatron critic checkpoint of this project (a run's checkpoints/iter_N/critic, or
    # `vapo-convert hf-to-mcore --critic`'s output). Same family and vocabulary as the policy;
    # checked before any work. Value pretraining is then optional (algo.value_pretrain_steps=0).
    # "": no warm start. Excludes model.critic_hf_path (a trunk whose head may start fresh).
    warm_start: str = ""
    # The critic's own layout on the same GPUs and processes as the actor: its TP, PP (VPP), EP (a
    # mixture-of-experts critic) and sequence parallelism, its DP what is left (world size / (tp * pp)).
    # A small critic at the actor's TP is slow (small matrices over many GPUs); at its own TP it runs
    # as wide as it needs. null: the actor's layout (`parallel`), bitwise today's run. Given, it is the
    # critic's whole layout: a field left out takes the parallel section's default (tp: 1, pp: 1, ...),
    # not the actor's value. May change on a resume (its checkpoint loads at any layout), but its ep not.
    parallel: ParallelConfig | None = None


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    actor_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-6))
    critic: CriticConfig = field(default_factory=CriticConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
