"""The VAPO loop: a Trainer whose step reads top to bottom (docs/algorithm.md).

Phases: optional supervised warm start ("sft"), value pretraining ("value_pretrain",
component 1: critic only, frozen policy, Monte-Carlo targets), then RL ("vapo"). One step:
    1. sample a group of prompts          5. advantages (algo.estimator: decoupled, length-adaptive
    2. rollout (+ dynamic sampling)          GAE; or GRPO's group-relative rewards)
    3. rewards (+ overlong shaping)       6. critic update
    4. old log-probs and values           7. actor update (PPO + NLL)
                                          8. weight sync into the rollout engines
The loop is estimator-blind: with algo.estimator=grpo the critic is mcore/critic.py's NoCritic,
whose values, fit and update do nothing, and the estimator is its record's function.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from model_providers import read_hf_config
from vapo_megatron.algorithms import step_stats
from vapo_megatron.checkpoint.complete import finished_message
from vapo_megatron.checkpoint.manager import CheckpointManager
from vapo_megatron.checkpoint.run_state import RunState
from vapo_megatron.checkpoint.trunk_copy import copy_trunk_across
from vapo_megatron.config import Config, resume, run_record
from vapo_megatron.config.determinism import determinism_env
from vapo_megatron.config.estimators import estimator_of
from vapo_megatron.config.layout import critic_parallel
from vapo_megatron.data.datasets import Datasets, repeat_warnings, stop_token_ids
from vapo_megatron.data.prompts import PromptSampler
from vapo_megatron.data.routes import replays
from vapo_megatron.evaluation.sampled import greedy_accuracy, sample_eval
from vapo_megatron.mcore import dp_stats, parallel, update
from vapo_megatron.mcore.actor import Actor, PolicyLossSettings
from vapo_megatron.mcore.critic import build_critic
from vapo_megatron.mcore.model import build_model
from vapo_megatron.mcore.offload import Offloader, check_host_memory
from vapo_megatron.mcore.optimizer import current_lr
from vapo_megatron.mcore.update import UpdateSettings
from vapo_megatron.rewards import build_reward_fn
from vapo_megatron.rewards.answers import AnswerKey
from vapo_megatron.rewards.scorer import Scorer
from vapo_megatron.rewards.shaping import OverlongShaping
from vapo_megatron.rollout.dynamic_sampling import StepRollouts
from vapo_megatron.rollout.generator import Generator
from vapo_megatron.trainer.deadline import Deadline, StepClock
from vapo_megatron.trainer.metrics import MetricsLogger
from vapo_megatron.trainer.run_guard import RunDirLock
from vapo_megatron.trainer.signals import StopSignals, request_requeue, stop_reason
from vapo_megatron.trainer.timing import PhaseTimer
from vapo_megatron.trainer.warm_start import load_critic_start

PREEMPTED_EXIT_CODE = 3  # checkpoint written after SIGUSR1/SIGTERM or at the deadline; the launcher may requeue
NON_FINITE_EXIT_CODE = 4  # trainer.max_consecutive_skips optimizer steps in a row had NaN/Inf


@dataclass(frozen=True)
class Planner:
    """What vapo-plan's models tell the loop, handed in by the command that builds the trainer
    (train.py, vapo-check), so the loop does not depend on the planner's cost model:
    check_engine_share(cfg, models): collective; raises ConfigError where a colocated engine's share
        and the resident trainer state exceed the GPU (sizing/plan.py);
    predict(cfg, actor_hf, critic_hf, world): (step s, save s, GPU name) for the deadline until
        measured, or None where the model has no rates (sizing/step_config.py)."""

    check_engine_share: Callable[[Config, list], None]
    predict: Callable[[Config, dict, dict, int], tuple[float, float, str] | None]


class Trainer:
    def __init__(self, cfg: Config, stop: StopSignals, planner: Planner):
        self.cfg = cfg
        self.planner = planner
        self.stop = stop  # SIGUSR1/SIGTERM, acted on at the next safe point (end of a step)
        self.deadline = Deadline.from_setting(cfg.trainer.deadline, cfg.trainer.deadline_margin_s)
        self.clock = StepClock()  # longest step and save so far, for the deadline
        determinism_env(cfg.trainer.deterministic)  # vapo-train set it before torch; here for direct callers
        c = critic_parallel(cfg)  # the critic's own layout (critic.parallel), or the actor's
        parallel.init_distributed(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, ep=cfg.parallel.ep,
                                  seed=cfg.trainer.seed, wait_timeout_s=cfg.rollout.wait_timeout_s,
                                  critic=(c.tp, c.pp, c.vpp, c.ep))
        # Before anything is written into the run directory: one trainer per run (run_guard.py).
        self.lock = RunDirLock.acquire(cfg.trainer.run_dir, rank0=parallel.is_rank0(), share=parallel.share_from_rank0)
        torch.manual_seed(cfg.trainer.seed)
        if cfg.trainer.deterministic:
            torch.use_deterministic_algorithms(True)
        a, t = cfg.algo, cfg.trainer
        self.data = Datasets.load(cfg, read_hf_config(cfg.model.hf_path))   # tokenizer, every split
        self.scorer = Scorer(build_reward_fn(cfg.reward.fn, correct_score=cfg.reward.correct_score,
                                             incorrect_score=cfg.reward.incorrect_score,
                                             timeout_s=cfg.reward.timeout_s),
                             self.data.tokenizer, stop_token_ids(self.data.tokenizer),
                             OverlongShaping(cfg.rollout.max_new_tokens, cfg.reward.overlong_buffer,
                                             cfg.reward.overlong_penalty))
        # The rollout engines; with routing replay (MoE models) they return each token's experts.
        self.generator = Generator.build(cfg, self.scorer.stop_token_ids,
                                         routes=replays(cfg, read_hf_config(cfg.model.hf_path)))
        # Steps 1-2: the step's prompts and rollouts (rollout.dynamic_sampling: DAPO's filter and refill)
        self.rollouts = StepRollouts(self.generator, self.scorer, cfg.rollout, mini_batches=cfg.algo.mini_batches)
        self.answers = AnswerKey(cfg.reward.fn, timeout_s=cfg.reward.timeout_s)  # maj@K; its pool starts at first use
        updates = UpdateSettings(mini_batches=a.mini_batches, epochs=a.ppo_epochs, max_tokens=t.micro_batch_tokens,
                                 max_consecutive_skips=t.max_consecutive_skips)
        self.actor = Actor(build_model(cfg, critic=False), PolicyLossSettings(
            eps_low=a.eps_low, eps_high=a.eps_high, dual_clip_c=a.dual_clip_c, loss_agg=a.loss_agg,
            nll_coef=a.nll_coef, temperature=cfg.rollout.temperature, chunk_tokens=t.logprob_chunk_tokens), updates)
        # an estimator without a critic: NoCritic, no value model at all
        self.critic = build_critic(cfg, updates, copy_across=copy_trunk_across)
        self.estimate = estimator_of(cfg).function()  # step 5, the record's (config/estimators.py)
        self.models = {"actor": self.actor.model, **self.critic.models}  # what is checkpointed and offloaded
        # trainer.offload_during_rollout: the state's size is known now (mcore/offload.py).
        self.offloader, self.bandwidth_logged = None, False
        if t.offload_during_rollout:
            check_host_memory(list(self.models.values()))  # every node, before any step
            self.offloader = Offloader(list(self.models.values()))
        else:  # the state stays on the GPU beside the engine's share (rollout.sglang.mem_fraction)
            self.planner.check_engine_share(cfg, list(self.models.values()))
        self.state = RunState(sampler=PromptSampler(self.data.train, cfg.rollout.prompts_per_step, cfg.data.seed))
        self.checkpoints = CheckpointManager(t.run_dir, self.models, config=run_record(cfg))
        if not self.checkpoints.load(self.state):                             # resume, when there is a checkpoint
            load_critic_start(cfg, self.models)  # a fresh run: critic.warm_start from a Megatron checkpoint
        # Only now: a refused or failed resume must not rewrite the run's record, nor a rerun of a
        # finished run that has nothing to train (its record keeps the settings it ran with).
        if parallel.is_rank0() and not self.nothing_to_train:
            resume.save(cfg)
        self.logger = MetricsLogger(t.run_dir, total_steps=self.total_iterations, start_step=self.state.iteration,
                                    sft_start=self.state.sft_steps_done, finished=self.state.finished,
                                    enabled=parallel.is_rank0(),
                                    tensorboard=t.tensorboard, wandb=self._start_wandb(), sft_steps=cfg.sft.steps)
        self.timer = PhaseTimer(absent=self.critic.absent_phases)  # perf/<phase>_s of every step (timing.py)
        if self.state.iteration == 0 and self.state.sft_steps_done == 0:  # a fresh run: once
            self.logger.log(0, "data", self.data.stats)
        if parallel.is_rank0():
            print("[vapo] data: " + ", ".join(f"{k.removeprefix('data/')}={v:g}" for k, v in self.data.stats.items()),
                  flush=True)
            for line in repeat_warnings(cfg, self.data):
                print(line, flush=True)
            self._predict_step_times()  # the deadline is rank 0's decision

    def _predict_step_times(self) -> None:
        """vapo-plan's step and save times for this config and GPU (the planner's predict) stand in for
        the deadline until this process has measured a step and a save (deadline.py StepClock). None
        on a device the model has no rates for (the CPU, an unknown GPU): then only measured times count."""
        cfg = self.cfg
        try:
            actor_hf = read_hf_config(cfg.model.hf_path)
            critic_hf = read_hf_config(cfg.model.critic_hf_path) if cfg.model.critic_hf_path else actor_hf
            predicted = self.planner.predict(cfg, actor_hf, critic_hf,
                                             parallel.tp_size() * parallel.pp_size() * parallel.dp_size())
        except Exception as e:  # noqa: BLE001 -- a prediction is a convenience, never a reason to stop a run
            print(f"[vapo] warning: deadline: no predicted step time ({e}); only measured times count", flush=True)
            return
        if predicted and predicted[0]:
            step_s, save_s, name = predicted
            self.clock.predicted_step_s, self.clock.predicted_save_s = step_s, save_s
            # Not "[vapo] deadline: ...": that prefix announces a stop (the Slurm tests wait for it).
            print(f"[vapo] predicted for the deadline until measured: a step {step_s:.0f} s, a checkpoint save "
                  f"{save_s:.0f} s ({name}; vapo-plan's step-time model, docs/slurm.md)", flush=True)

    @property
    def total_iterations(self) -> int:
        return self.cfg.algo.value_pretrain_steps + self.cfg.trainer.total_steps

    @property
    def nothing_to_train(self) -> bool:
        """A rerun of a finished run whose trainer.total_steps asks for no more iterations."""
        return self.state.finished and self.state.iteration >= self.total_iterations

    # ---- the run ---------------------------------------------------------------------------

    def run(self) -> int:
        cfg = self.cfg
        if self.nothing_to_train:  # a rerun of a finished run: its final eval, export and save are done
            # (a longer trainer.total_steps trains on)
            if parallel.is_rank0():
                print(finished_message(cfg.trainer.run_dir, self.state.iteration, cfg.trainer.total_steps,
                                       self.total_iterations), flush=True)
            return 0
        if not self.state.sft_finished and cfg.sft.steps > 0:
            self.warm_start()
            self.checkpoints.save(self.state)  # never redo SFT
        self.generator.sync_weights(self.actor.model, version=self.state.iteration)
        if self.state.iteration == 0 and self.data.eval:
            self.log_eval("before_vapo")
        self.state.finished = False  # until the final save below
        if parallel.is_rank0():  # nothing measured yet: the prediction, if any, says whether a step fits
            fits, why = self.deadline.next_step_fits(self.clock)
            if not fits:
                print(f"[vapo] warning: deadline: {why}; the first step of this job starts anyway (it is checked "
                      "again, with measured times, after it)", flush=True)
        self.timer.start()
        while self.state.iteration < self.total_iterations:
            t0 = time.perf_counter()
            self.train_step()
            self.state.iteration += 1
            it = self.state.iteration
            rl_step = it - cfg.algo.value_pretrain_steps
            if (self.data.eval and cfg.eval.every and rl_step > 0 and rl_step % cfg.eval.every == 0
                    and it < self.total_iterations):
                with self.timer("eval"):
                    self.log_eval("periodic")
            self.clock.add_step(time.perf_counter() - t0)
            reason = stop_reason(self.stop, self.deadline, self.clock, final=it == self.total_iterations)
            if reason:
                self._save()
                if reason not in ("SIGTERM", "SIGINT"):  # preempted (Slurm requeues), cancelled or Ctrl-C (it must not)
                    request_requeue()
                if parallel.is_rank0():
                    print(f"[vapo] stop ({reason}): checkpoint at iteration {it} written, exiting with "
                          f"{PREEMPTED_EXIT_CODE}", flush=True)
                return PREEMPTED_EXIT_CODE
            if it % cfg.trainer.save_every == 0 and it < self.total_iterations:
                with self.timer("checkpoint"):
                    self._save()
        if self.data.eval:
            self.log_eval("final")
        if cfg.trainer.export_hf:
            self.export_hf()
        self.state.finished = True
        self.checkpoints.save(self.state)  # last: a crash before it redoes the final eval and export
        return 0

    def train_step(self) -> None:
        timed = self.timer
        pretraining = self.state.iteration < self.cfg.algo.value_pretrain_steps and not self.state.pretrain_finished
        t0 = time.perf_counter()
        with self._offloaded(timed=True):  # trainer.offload_during_rollout: state on the host until scoring
            with timed("rollout"):
                rollout, sampling_logs = self.rollouts.collect(self.state.sampler, seed=self._rollout_seed(),  # 1, 2
                                                               carry=self.state.carry,
                                                               version=self.state.policy_version)
                self.generator.release_weights()  # colocated SGLang: its GPU memory goes to training until step 8
        with timed("reward"):
            batch, reward_logs = self.scorer.score(rollout)                                  # 3
        with timed("score"):
            batch.old_logp, entropy, replay_logs = self.actor.log_probs(batch)               # 4
            batch.values = self.critic.values(batch)
        off_logs, estimator_logs = self._advantages(batch, value_pretrain=pretraining)      # 5
        fit_logs = self.critic.fit(batch)  # critic/explained_variance of the old values (none without a critic)
        with timed("critic_update"):
            critic_logs = self.critic.update(batch, value_pretrain=pretraining)              # 6
        actor_logs: dict[str, float] = {}
        if pretraining:
            self._count_value_pretraining(fit_logs)
        else:
            with timed("actor_update"):
                actor_logs = self.actor.update(batch)                                        # 7
        with timed("sync"):  # also while value pretraining (actor unchanged): the engine released its weights
            self.generator.sync_weights(self.actor.model, version=self.state.iteration + 1)   # 8
        self._log_step("value_pretrain" if pretraining else "vapo", batch, entropy, sampling_logs, reward_logs,
                       replay_logs, off_logs, estimator_logs, fit_logs, critic_logs, actor_logs,
                       seconds=time.perf_counter() - t0)

    def _advantages(self, batch, *, value_pretrain: bool) -> tuple[dict[str, float], dict[str, float]]:
        """Step 5 on `batch`, in place: partial rollout's off-policy weights (decoupled PPO), the
        estimator's advantages and returns, and whitening if asked; (off-policy logs, estimator logs).
        Every global figure is exact over DP through the reductions handed in (algorithms/step_stats.py)."""
        algo, off_logs = self.cfg.algo, {}
        if "token_versions" in batch.extras:  # carried-over tokens (rollout.partial)
            p = self.cfg.rollout.partial
            batch.extras["is_weights"], off_logs = step_stats.off_policy_weights(
                batch, version=self.state.policy_version, cap=p.is_cap, max_staleness=p.max_staleness,
                reduce=dp_stats.dp_sum, reduce_max=dp_stats.dp_max)
        batch.advantages, batch.returns, estimator_logs = self.estimate(batch, algo, value_pretrain=value_pretrain,
                                                                        dp_sum=dp_stats.dp_sum)
        if algo.whiten_advantages:
            batch.advantages = step_stats.whiten_advantages(batch.advantages, batch.mask, reduce=dp_stats.dp_sum)
        return off_logs, estimator_logs

    def _count_value_pretraining(self, fit_logs: dict[str, float]) -> None:
        """A value-pretraining step done; it ends early once the old values explain enough of the
        returns (algo.value_pretrain_ev_threshold)."""
        self.state.pretrain_steps_done += 1
        threshold = self.cfg.algo.value_pretrain_ev_threshold
        if threshold is not None and fit_logs["critic/explained_variance"] >= threshold:
            self.state.pretrain_finished = True

    def _log_step(self, phase: str, batch, entropy, *parts: dict, seconds: float) -> None:
        cfg = self.cfg
        logs = {k: v for part in parts for k, v in part.items()}
        logs |= {
            "actor/entropy_rollout": step_stats.global_mean(entropy, batch.mask, reduce=dp_stats.dp_sum),
            # over the step's own phases, not the eval/checkpoint before it
            "perf/tokens_per_s": dp_stats.global_sum(float(batch.seq_lens.sum())) / seconds,
            "perf/padding_ratio": update.padding_ratio(batch, cfg.trainer.micro_batch_tokens),
        }
        if "actor/lr" not in logs:  # no actor update this step: the rate its next update uses
            logs["actor/lr"] = current_lr(self.actor.model.optimizer)
        if "engine_logp" in batch.extras:
            logs["rollout/logprob_diff"] = step_stats.engine_logprob_diff(batch, reduce=dp_stats.dp_sum)
        if "actor/entropy" not in logs:
            logs["actor/entropy"] = logs["actor/entropy_rollout"]
        logs |= self.timer.lap()  # perf/<phase>_s, perf/other_s, perf/step_s (timing.py)
        self.logger.log(self.state.iteration + 1, phase, logs)

    def warm_start(self) -> None:
        """Optional supervised phase on correct examples before RL (the demo's base model
        is random; the paper's base had been pretrained). Reuses the actor's NLL loss."""
        from vapo_megatron.trainer.warm_start import sft_steps

        for step, logs, finished in sft_steps(self.cfg, self.actor.model, self.data, self.generator, self.scorer,
                                              start=self.state.sft_steps_done):
            self.state.sft_steps_done = step + 1
            self.state.sft_finished = finished
            self.logger.log(0, "sft", logs, tb_step=step + 1)
        self.actor.model.optimizer.reload_model_params()  # the optimizer's (fp32 main) copy follows the weights
        self.critic.start_from(self.actor.model)  # from the warm-started trunk (component 1); no-op without a critic

    def log_eval(self, when: str) -> None:
        """Greedy accuracy and the sampled figures (eval/avg@K, eval/pass@k, eval/maj@K). The
        sampled eval always uses the same seed: checkpoints are compared on the same draws."""
        e = self.cfg.eval
        with self._offloaded(timed=False):  # generation only: the engine's KV cache takes the memory
            acc = greedy_accuracy(self.generator, self.scorer, self.data.eval)
            sampled = sample_eval(self.generator, self.scorer, self.answers, self.data.eval, n=e.n_samples,
                                  seed=self.cfg.trainer.seed,
                                  temperature=self.cfg.rollout.temperature if e.temperature is None else e.temperature)
        figures = {f"eval/{k}": v for k, v in sampled.summary.items()} if sampled is not None else {}  # rank 0 only
        self.logger.log(self.state.iteration, "eval", {"eval/accuracy": acc, f"eval/accuracy_{when}": acc, **figures})
        if parallel.is_rank0():
            K = e.n_samples
            print(f"[vapo] eval ({when}) at iteration {self.state.iteration}: accuracy {acc:.3f}, avg@{K} "
                  f"{figures[f'eval/avg@{K}']:.3f}, pass@{K} {figures[f'eval/pass@{K}']:.3f}, "
                  f"maj@{K} {figures[f'eval/maj@{K}']:.3f}", flush=True)

    def export_hf(self):
        """The final actor as an HF directory, run_dir/hf (weights/convert.py)."""
        from pathlib import Path

        from vapo_megatron.weights.convert import export_hf_dir

        m = self.actor.model
        return export_hf_dir(m.modules, m.family, m.hf_cfg, Path(self.cfg.trainer.run_dir) / "hf", files_src=m.hf_dir,
                             critic=False, dtype=m.dtype)

    # ---- helpers ---------------------------------------------------------------------------

    def _start_wandb(self):
        """Rank 0's W&B run (trainer/wandb_run.py), or None: off, another rank, or a rerun of a
        finished run (nothing to log; the W&B run stays finished)."""
        if not parallel.is_rank0() or self.cfg.trainer.wandb.mode == "disabled":
            return None
        if self.nothing_to_train:
            return None
        from vapo_megatron.trainer.wandb_run import WandbTracker

        return WandbTracker.start(self.cfg.trainer.wandb, self.cfg.trainer.run_dir, run_record(self.cfg))

    def _rollout_seed(self) -> int:
        # A pure function of (seed, iteration, DP rank): a resumed run samples the same rollouts.
        return (self.cfg.trainer.seed * 1_000_003 + self.state.iteration * 7919 + parallel.dp_rank()) % (2**31 - 1)

    @contextmanager
    def _offloaded(self, *, timed: bool):
        """With trainer.offload_during_rollout, the actor's and critic's state is in host memory
        inside the block (mcore/offload.py); it is entered after the weight sync that reads the
        actor's parameters and before the engine resumes its KV cache (Generator.generate), and
        left, even on an error, before anything reads the models again. `timed`: as the step's
        perf/offload_s and perf/onload_s (an eval's moves count in perf/eval_s)."""
        if self.offloader is None:
            yield
            return
        with self.timer("offload") if timed else _untimed():
            self.offloader.offload()
        try:
            yield
        finally:
            with self.timer("onload") if timed else _untimed():
                self.offloader.onload()
            if not self.bandwidth_logged and parallel.is_rank0():
                print(f"[vapo] trainer state offloaded during rollout (rank 0): {self.offloader.bandwidth_line()}",
                      flush=True)
            self.bandwidth_logged = True

    def _save(self) -> None:
        if self.offloader is not None and self.offloader.offloaded:
            raise RuntimeError("checkpoint save while the trainer's state is in host memory")
        t0 = time.perf_counter()
        self.checkpoints.save(self.state)
        self.clock.add_save(time.perf_counter() - t0)

    def close(self) -> None:
        if self.offloader is not None and not self.offloader.offloaded:
            self.offloader.close()  # unpin the host buffer
        self.logger.close()
        self.answers.close()
        self.generator.close()
        self.scorer.close()
        self.lock.release()


@contextmanager
def _untimed():
    yield


__all__ = ["NON_FINITE_EXIT_CODE", "PREEMPTED_EXIT_CODE", "Trainer"]
