"""The step-time model's inputs (sizing/step_time.py Setup): one iteration's shapes, layout and
batch as numbers, built from a run config by step_config.py. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from vapo_megatron.sizing.flops import Shapes


@dataclass(frozen=True)
class Setup:
    """Everything one estimate needs, as numbers (setup_from_config builds it from a run config)."""

    actor: Shapes
    critic: Shapes | None  # None: no critic (algo.estimator=grpo)
    world: int
    gpus_per_node: int
    tp: int
    pp: int
    vpp: int | None
    ep: int  # parallel.ep
    engine_tp: int  # GPUs per engine: rollout.sglang.tp
    kv_tokens: int  # KV-cache tokens per engine
    prompts: int  # rollout.prompts_per_step
    samples: int  # prompts x rollout.n_samples
    prompt_tokens: float  # mean prompt length
    response_tokens: float  # mean response length
    max_response_tokens: int  # rollout.max_new_tokens: the tail
    micro_batch_tokens: int
    mini_batches: int
    ppo_epochs: int
    recompute: bool
    distributed_optimizer: bool
    offload_bytes_per_gpu: int  # copied to the host and back per step (0: no offload)
    checkpoint_bytes: int
    save_every: int
    storage_bytes_s: float  # what the job can write to its file system, all nodes together
    bucket_bytes: int  # rollout.weight_sync_bucket_mb
    value_pretrain_steps: int = 0
    total_steps: int = 0
    evals: int = 0  # evaluations over the run
    eval_prompts: int = 0  # prompts of one evaluation: one greedy response each, then eval_samples sampled
    eval_samples: int = 0  # eval.n_samples
    # Forward passes of a reference policy at scoring (0 here: VAPO, GRPO and DAPO as configured
    # have no KL term; NeMo-RL's published GRPO runs have one).
    reference_forwards: int = 0
    partial: bool = False  # rollout.partial.enabled: the step's rollout phase is partial_rollout's
    spare_batches: int = 1  # rollout.partial.spare_batches
    max_staleness: int = 1  # rollout.partial.max_staleness
    # critic.parallel: the critic's own (tp, pp, vpp, ep); None: the actor's layout.
    critic_layout: tuple[int, int, int | None, int] | None = None

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    def layout(self, critic: bool) -> tuple[int, int, int | None, int, int]:
        """(tp, pp, vpp, ep, dp) of the actor, or of the critic (its own with critic_layout)."""
        if critic and self.critic_layout is not None:
            tp, pp, vpp, ep = self.critic_layout
            return tp, pp, vpp, ep, self.world // (tp * pp)
        return self.tp, self.pp, self.vpp, self.ep, self.dp

    @property
    def engines(self) -> int:
        return self.world // self.engine_tp

    @property
    def sequence_tokens(self) -> float:
        return self.prompt_tokens + self.response_tokens

    @property
    def tokens(self) -> float:
        """Prompt + response tokens of one step's samples."""
        return self.samples * self.sequence_tokens


__all__ = ["Setup"]
