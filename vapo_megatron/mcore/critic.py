"""The critic on Megatron: values V_t (step 4, forward only) and the clipped value-loss update (step 6).

Value loss of the global mini-batch (token-level, like the policy loss, VAPO sec. 3):
    L_V = (1/N) sum_i sum_t 0.5 * max((V - G)^2, (clip(V, V_old - c, V_old + c) - G)^2)
Each micro-batch returns (value_loss_sum, its response tokens); finalize_model_grads divides
by their global total N (schedule.py), so the gradient is exactly grad L_V. Returns G_t come
from GAE with lambda_critic (1.0: Monte-Carlo returns, component 2).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from vapo_megatron.algorithms import step_stats
from vapo_megatron.algorithms.losses import value_loss_sum
from vapo_megatron.algorithms.normalization import GlobalCounts
from vapo_megatron.config import Config
from vapo_megatron.config.estimators import estimator_of
from vapo_megatron.data.batch import RolloutBatch
from vapo_megatron.mcore import critic_share, dp_stats, parallel
from vapo_megatron.mcore.model import TrainModel, build_model, copy_trunk
from vapo_megatron.mcore.update import UpdateSettings, forward_only, mini_batch_rows, optimize


def value_outputs(mb: RolloutBatch, values: torch.Tensor):
    # values: [b, S] float32, V at every position (masked to prediction positions)
    zero = values.new_zeros(())
    return (zero, torch.tensor(1, dtype=torch.int),
            {"values": (values.detach().float() * mb.mask.to(values.device)).cpu()})


def value_loss(mb: RolloutBatch, values: torch.Tensor, *, clip_range: float | None):
    device = values.device
    mask = mb.mask.to(device)
    loss_sum, metrics = value_loss_sum(
        values.float(), mb.values.to(device), mb.returns.to(device), mask, clip_range=clip_range,
    )
    logs = {  # sums; update.py divides by the global N
        "critic/value_clipfrac_sum": metrics["clipped_tokens"],
        "critic/value_mse_sum": metrics["squared_error_sum"],
    }
    logs["critic/value_loss_sum"] = loss_sum.detach()  # / N -> L_V
    return loss_sum, mask.sum().int().cpu(), logs


class Critic:
    """The value model: a TrainModel with the value clip of its updates. At a layout of its own
    (critic.parallel), every call runs at that layout (`with parallel.role("critic")`), and the
    step's rows travel to the critic's DP ranks and its values back (critic_share.py); at the
    actor's layout both are nothing."""

    absent_phases: tuple[str, ...] = ()  # of the step's timed phases (trainer/timing.py), none

    def __init__(self, model: TrainModel, clip_range: float | None, update: UpdateSettings, *, own_trunk: bool = False,
                 passes: int = 1, scratch: Path | None = None, copy_across: Callable | None = None):
        self.model, self.clip_range, self.settings = model, clip_range, update
        self.passes = passes  # critic.updates_per_step: K passes of the update per RL step
        self.own_trunk = own_trunk  # critic_hf_path or critic.warm_start: its own trunk, kept after SFT
        self.own_layout = parallel.own_layout("critic")
        # At its own layout the policy's trunk reaches it through a dist checkpoint in `scratch`
        # (checkpoint/trunk_copy.py, handed in by the trainer: checkpoints are a layer above this one).
        self.scratch, self.copy_across = scratch, copy_across

    def start_from(self, actor: TrainModel) -> None:
        """After the warm start: the critic starts from the policy that RL starts from, with its
        fresh value head (component 1), unless it has a trunk of its own."""
        if self.own_trunk:
            return
        if self.own_layout:
            self.copy_across(actor, self.model, self.scratch)
        else:
            copy_trunk(actor, self.model)

    @property
    def models(self) -> dict[str, TrainModel]:
        """What the checkpoints, the offload and the warm start's trunk copy hold of it."""
        return {"critic": self.model}

    def fit(self, batch: RolloutBatch) -> dict[str, float]:
        """How well the old values V_t predicted the step's returns G_t, before the update."""
        return {"critic/explained_variance": step_stats.explained_variance(batch.values, batch.returns, batch.mask,
                                                                           reduce=dp_stats.dp_sum)}

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """Step 4: V_t at every prediction position, [B, S] of this actor rank's rows."""
        if not self.own_layout:
            return forward_only(self.model, batch, value_outputs, ("values",), self.settings.max_tokens)["values"]
        rows, share = critic_share.to_critic(batch, [list(range(batch.size))])
        with parallel.role("critic"):
            values = forward_only(self.model, rows, value_outputs, ("values",), self.settings.max_tokens)["values"]
        return critic_share.values_to_actor(values, share, batch)

    def update(self, batch: RolloutBatch, *, value_pretrain: bool) -> dict[str, float]:
        """Step 6: clipped value loss against `batch.returns`, token-level over each mini-batch;
        K passes of it in an RL step (critic.updates_per_step), one while value pretraining. Each
        pass is algo.ppo_epochs epochs, so K passes are K x ppo_epochs epochs of one optimize call
        (the logs are means over all of them)."""
        def loss_for(counts: GlobalCounts):
            return partial(value_loss, clip_range=self.clip_range)

        passes = 1 if value_pretrain else self.passes
        parts = None
        if self.own_layout:  # the same global mini-batches, dealt over the critic's DP ranks
            batch, share = critic_share.to_critic(batch, mini_batch_rows(batch, self.settings.mini_batches))
            parts = share.parts
        with parallel.role("critic"):
            logs = optimize(self.model, "critic", batch, loss_for,
                            replace(self.settings, epochs=self.settings.epochs * passes), parts=parts)
        if self.passes != 1:  # only a run that sets K logs it: the default run's records stay as they were
            logs["critic/updates_per_step"] = float(passes)
        return logs


class NoCritic:
    """algo.estimator=grpo: there is no value model. Every call the loop makes on a critic is
    here and does nothing, so the step reads the same for every estimator; nothing is built,
    checkpointed, offloaded or logged (no critic/* metrics, no critic update time)."""

    models: dict[str, TrainModel] = {}
    absent_phases = ("critic_update",)  # no perf/critic_update_s (trainer/timing.py)

    def start_from(self, actor: TrainModel) -> None:
        pass

    def values(self, batch: RolloutBatch) -> None:
        return None

    def fit(self, batch: RolloutBatch) -> dict[str, float]:
        return {}

    def update(self, batch: RolloutBatch, *, value_pretrain: bool) -> dict[str, float]:
        return {}


def build_critic(cfg: Config, update: UpdateSettings, *, copy_across: Callable | None = None) -> Critic | NoCritic:
    """Collective. The value model algo.estimator needs (its record, config/estimators.py): a Critic or none.
    copy_across(actor, critic, scratch): the policy's trunk into a critic at its own layout."""
    if not estimator_of(cfg).needs_critic:
        return NoCritic()
    own_trunk = bool(cfg.model.critic_hf_path or cfg.critic.warm_start)  # not the policy's after SFT
    with parallel.role("critic"):
        model = build_model(cfg, critic=True)
    return Critic(model, cfg.algo.value_clip, update, own_trunk=own_trunk, passes=cfg.critic.updates_per_step,
                  scratch=Path(cfg.trainer.run_dir) / "critic_trunk.tmp", copy_across=copy_across)


__all__ = ["Critic", "NoCritic", "build_critic", "value_loss", "value_outputs"]
