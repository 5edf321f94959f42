"""vapo-train: the VAPO loop (../shared/VAPO.md), one entry point for every launcher.

    vapo-train --config configs/demo_cpu.yaml trainer.total_steps=5
    torchrun --nproc-per-node 2 -m vapo_megatron.train --config FILE [dotted.key=value ...]

Phases: optional supervised warm start ("sft"), value pretraining ("value_pretrain",
component 1: critic only, frozen policy, Monte-Carlo targets), then VAPO ("vapo"). One step:
    1. sample a group of prompts          5. decoupled, length-adaptive GAE
    2. rollout                            6. critic update
    3. rewards                            7. actor update (PPO + NLL)
    4. old log-probs and values           8. weight sync into the rollout engines
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from vapo_megatron import faults, parallel, run_config
from vapo_megatron.actor import PolicyLossSettings
from vapo_megatron.advantages import compute_advantages, policy_lambdas
from vapo_megatron.algorithms.losses import masked_moment_sums, whiten
from vapo_megatron.batch import pad_ragged, to_sequence
from vapo_megatron.config import Config, ConfigError, load_config
from vapo_megatron.data.prompts import PromptDataError
from vapo_megatron.deadline import Deadline, StepClock
from vapo_megatron.metrics import MetricsLogger
from vapo_megatron.phase_timer import PhaseTimer
from vapo_megatron.preflight import validate_startup
from vapo_megatron.rollout_collect import RolloutContext, collect_rollouts, evaluate, release_engine_weights
from vapo_megatron.sampled_eval import sample_eval
from vapo_megatron.run_state import (
    CheckpointCorrupt,
    RunState,
    build_models,
    load_run_state,
    save_run_state,
    start_critic_from_policy,
    sync_weights,
)
from vapo_megatron.stop_signals import StopSignals, request_requeue
from vapo_megatron.updates import (
    NonFiniteError,
    batch_padding_ratio,
    explained_variance,
    score_with_models,
    update_actor,
    update_critic,
)

PREEMPTED_EXIT_CODE = 3  # checkpoint written after SIGUSR1/SIGTERM or at the deadline; the launcher may requeue
NON_FINITE_EXIT_CODE = 4  # trainer.max_consecutive_skips optimizer steps in a row had NaN/Inf


class Trainer:
    def __init__(self, cfg: Config, stop: StopSignals):
        self.cfg = cfg
        self.stop = stop  # SIGUSR1/SIGTERM, acted on at the next safe point (end of a step)
        self.deadline = Deadline.from_setting(cfg.trainer.deadline, cfg.trainer.deadline_margin_s)
        self.clock = StepClock()  # longest step and save so far, for the deadline
        self.layout = parallel.init_distributed(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, seed=cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        if cfg.trainer.deterministic:
            torch.use_deterministic_algorithms(True)
        self.ctx = RolloutContext.build(cfg)                        # tokenizer, prompts, reward, engine
        self.actor, self.critic = build_models(cfg, self.ctx.hf_cfg)
        self.state: RunState = load_run_state(cfg, self.actor, self.critic, self.ctx)
        self.logger = MetricsLogger(
            cfg.trainer.run_dir, total_steps=self.total_iterations, start_step=self.state.iteration,
            enabled=parallel.is_rank0(), tensorboard=cfg.trainer.tensorboard,
        )
        self.logger.truncate_after(self.state.iteration)
        self.timer = PhaseTimer()  # perf/<phase>_s of every step (phase_timer.py)
        if self.state.iteration == 0 and self.state.sft_steps_done == 0:  # a fresh run: once
            self.logger.log(0, "data", self.ctx.data_stats)
        if parallel.is_rank0():
            print("[vapo] data: " + ", ".join(f"{k.removeprefix('data/')}={v:g}" for k, v in self.ctx.data_stats.items()), flush=True)

    @property
    def total_iterations(self) -> int:
        return self.cfg.algo.value_pretrain_steps + self.cfg.trainer.total_steps

    # ---- the run ---------------------------------------------------------------------------

    def run(self) -> int:
        cfg = self.cfg
        if not self.state.sft_finished and cfg.sft.steps > 0:
            self.warm_start()
            save_run_state(cfg, self.state, self.actor, self.critic, self.ctx)  # never redo SFT
        sync_weights(self.actor, self.ctx.engine, version=self.state.iteration, cfg=cfg)
        if self.state.iteration == 0 and self.ctx.eval_records:
            self.log_eval("before_vapo")
        if self.state.iteration >= self.total_iterations and parallel.is_rank0():
            print(f"[vapo] the run in {cfg.trainer.run_dir} has finished all {self.total_iterations} iterations: "
                  "nothing to train", flush=True)
        self.timer.start()
        while self.state.iteration < self.total_iterations:
            t0 = time.perf_counter()
            self.train_step()
            self.state.iteration += 1
            it = self.state.iteration
            if self.ctx.eval_records and it > cfg.algo.value_pretrain_steps and (it - cfg.algo.value_pretrain_steps) % cfg.eval.every == 0 and it < self.total_iterations:
                with self.timer("eval"):
                    self.log_eval("periodic")
            self.clock.add_step(time.perf_counter() - t0)
            reason = self._should_stop(final=it == self.total_iterations)
            if reason:
                self._save()
                if reason != "SIGTERM":  # SIGTERM: preempted (Slurm requeues) or cancelled (it must not)
                    request_requeue()
                if parallel.is_rank0():
                    print(f"[vapo] stop ({reason}): checkpoint at iteration {it} written, exiting with "
                          f"{PREEMPTED_EXIT_CODE}", flush=True)
                return PREEMPTED_EXIT_CODE
            if it % cfg.trainer.save_every == 0 and it < self.total_iterations:
                with self.timer("checkpoint"):
                    self._save()
        if self.ctx.eval_records:
            self.log_eval("final")
        save_run_state(cfg, self.state, self.actor, self.critic, self.ctx, final=True)
        return 0

    def train_step(self) -> None:
        cfg, algo, timed = self.cfg, self.cfg.algo, self.timer
        phase = "value_pretrain" if self.state.iteration < algo.value_pretrain_steps and not self.state.pretrain_finished else "vapo"
        t0 = time.perf_counter()
        faults.set_iteration(self.state.iteration)  # test-only fault injection (faults.py)
        with timed("rollout"):
            prompts = self.state.sampler.next_batch()                                    # 1
            rollout = collect_rollouts(self.ctx, prompts, seed=self._rollout_seed())      # 2
            release_engine_weights(self.ctx)  # colocated SGLang: its GPU memory goes to training until step 8
        faults.fault_point("rollout")
        faults.fault_point("usr1")
        with timed("reward"):
            batch, reward_logs = self.ctx.score(rollout)                                  # 3
        with timed("score"):
            batch.old_logp, entropy, batch.values = score_with_models(                    # 4
                self.actor, self.critic, batch, temperature=cfg.rollout.temperature,
                max_tokens=cfg.trainer.micro_batch_tokens, chunk_tokens=cfg.trainer.logprob_chunk_tokens,
            )
        batch.advantages, batch.returns = compute_advantages(batch, algo, value_pretrain=phase == "value_pretrain")  # 5
        if algo.whiten_advantages:
            batch.advantages = self._whiten(batch)
        if faults.poisoned("nan_loss"):  # test-only: NaN losses and gradients in both models
            batch.advantages = torch.full_like(batch.advantages, float("nan"))
            batch.returns = torch.full_like(batch.returns, float("nan"))
        ev = explained_variance(batch)
        with timed("critic_update"):
            critic_logs = update_critic(                                                  # 6
                self.critic, batch, clip_range=algo.value_clip, mini_batches=algo.mini_batches,
                epochs=algo.ppo_epochs, max_tokens=cfg.trainer.micro_batch_tokens, lr=cfg.critic_optim.lr,
                max_consecutive_skips=cfg.trainer.max_consecutive_skips,
            )
        actor_logs: dict[str, float] = {}
        if phase == "vapo":
            with timed("actor_update"):
                actor_logs = update_actor(                                                # 7
                    self.actor, batch, self._policy_settings(), mini_batches=algo.mini_batches,
                    epochs=algo.ppo_epochs, max_tokens=cfg.trainer.micro_batch_tokens, lr=cfg.actor_optim.lr,
                    max_consecutive_skips=cfg.trainer.max_consecutive_skips,
                )
        else:
            self.state.pretrain_steps_done += 1
            threshold = algo.value_pretrain_ev_threshold
            if threshold is not None and ev >= threshold:
                self.state.pretrain_finished = True
        # 8: also while value pretraining (actor unchanged): the engine released its weights.
        with timed("sync"):
            sync_weights(self.actor, self.ctx.engine, version=self.state.iteration + 1, cfg=cfg)   # 8
        dt = time.perf_counter() - t0
        tokens = self._global_sum(float(batch.seq_lens.sum()))
        logs = {
            **reward_logs, **critic_logs, **actor_logs,
            "critic/explained_variance": ev,
            "actor/entropy_rollout": self._global_mean(entropy, batch.mask),
            "actor/lambda_policy_mean": float(policy_lambdas(batch.response_lens, algo).mean()),
            "perf/tokens_per_s": tokens / dt,  # over the step's own phases, not the eval/checkpoint before it
            "perf/padding_ratio": batch_padding_ratio(batch, cfg.trainer.micro_batch_tokens),
        }
        if "engine_logp" in batch.extras:
            logs["rollout/logprob_diff"] = self._engine_logprob_diff(batch)
        if "actor/entropy" not in logs:
            logs["actor/entropy"] = logs["actor/entropy_rollout"]
        logs |= timed.lap()  # perf/<phase>_s, perf/other_s, perf/step_s (phase_timer.py)
        self.logger.log(self.state.iteration + 1, phase, logs)

    def warm_start(self) -> None:
        """Optional supervised phase on correct examples before RL (the demo's base model
        is random; the paper's base had been pretrained). Reuses the actor's NLL loss."""
        from vapo_megatron.warm_start import sft_steps

        for step, logs, finished in sft_steps(self.cfg, self.actor, self.ctx, start=self.state.sft_steps_done):
            self.state.sft_steps_done = step + 1
            self.state.sft_finished = finished
            self.logger.log(0, "sft", logs, tb_step=step + 1)
        if self.cfg.model.critic_hf_path:
            self.actor.optimizer.reload_model_params()
        else:  # the critic starts from the policy that RL starts from (component 1)
            start_critic_from_policy(self.actor, self.critic)

    def log_eval(self, when: str) -> None:
        """Greedy accuracy and the sampled figures (eval/avg@K, eval/pass@k, eval/maj@K). The
        sampled eval always uses the same seed: checkpoints are compared on the same draws."""
        acc = evaluate(self.ctx)
        e = self.cfg.eval
        sampled = sample_eval(self.ctx, self.ctx.eval_records, n=e.n_samples, seed=self.cfg.trainer.seed,
                              temperature=self.cfg.rollout.temperature if e.temperature is None else e.temperature)
        figures = {f"eval/{k}": v for k, v in sampled.summary.items()} if sampled is not None else {}  # rank 0 only
        self.logger.log(self.state.iteration, "eval", {"eval/accuracy": acc, f"eval/accuracy_{when}": acc, **figures})
        if parallel.is_rank0():
            K = e.n_samples
            print(f"[vapo] eval ({when}) at iteration {self.state.iteration}: accuracy {acc:.3f}, avg@{K} "
                  f"{figures[f'eval/avg@{K}']:.3f}, pass@{K} {figures[f'eval/pass@{K}']:.3f}, maj@{K} {figures[f'eval/maj@{K}']:.3f}", flush=True)

    # ---- helpers ---------------------------------------------------------------------------

    def _policy_settings(self) -> PolicyLossSettings:
        a = self.cfg.algo
        return PolicyLossSettings(
            eps_low=a.eps_low, eps_high=a.eps_high, dual_clip_c=a.dual_clip_c, loss_agg=a.loss_agg,
            nll_coef=a.nll_coef, temperature=self.cfg.rollout.temperature,
            chunk_tokens=self.cfg.trainer.logprob_chunk_tokens,
        )

    def _rollout_seed(self) -> int:
        # A pure function of (seed, iteration, DP rank): a resumed run samples the same rollouts.
        return (self.cfg.trainer.seed * 1_000_003 + self.state.iteration * 7919 + parallel.dp_rank()) % (2**31 - 1)

    def _engine_logprob_diff(self, batch) -> float:
        """Mean |engine log-prob - trainer log-prob| over response tokens: the rollout/trainer
        mismatch (kernels, precision) that recomputing old log-probs protects PPO from."""
        engine = to_sequence(pad_ragged(batch.extras["engine_logp"]), batch.prompt_lens,
                             batch.response_lens, batch.tokens.shape[1])
        return self._global_mean((engine - batch.old_logp).abs(), batch.mask)

    def _whiten(self, batch):
        sums = masked_moment_sums(batch.advantages, batch.mask).double()
        if parallel.dp_size() > 1:
            parallel.all_reduce(sums, group=parallel.dp_group())
        return whiten(batch.advantages, batch.mask, sums)

    def _global_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        if parallel.dp_size() > 1:
            parallel.all_reduce(t, group=parallel.dp_group())
        return float(t)

    def _global_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        t = torch.tensor([float((x * mask).sum()), float(mask.sum())], dtype=torch.float64)
        if parallel.dp_size() > 1:
            parallel.all_reduce(t, group=parallel.dp_group())
        return float(t[0] / t[1].clamp(min=1))

    def _save(self) -> None:
        t0 = time.perf_counter()
        save_run_state(self.cfg, self.state, self.actor, self.critic, self.ctx)
        self.clock.add_save(time.perf_counter() - t0)

    def _should_stop(self, *, final: bool) -> str:
        """Collective: why every rank stops after this step, "" to go on. A signal on any rank, or
        rank 0's finding that the next step and a save no longer fit before the deadline. After
        the final step only SIGTERM stops: finishing (final eval, export) beats a requeue that
        would redo them."""
        fits, why = (True, "") if final or not parallel.is_rank0() else self.deadline.next_step_fits(self.clock)
        flag = torch.tensor([self.stop.signum, int(not fits)], dtype=torch.int64)
        parallel.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step (SIGTERM > SIGUSR1)
        signum, late = int(flag[0]), bool(flag[1])
        if signum == signal.SIGTERM or (signum and not final):
            return signal.Signals(signum).name
        if signum and parallel.is_rank0():
            print("[vapo] SIGUSR1 during the final step: finishing the run (final eval, save, export), no requeue", flush=True)
        if late:
            if parallel.is_rank0():
                print(f"[vapo] deadline: {why}", flush=True)
            return "deadline"
        return ""

    def close(self) -> None:
        self.logger.close()
        self.ctx.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vapo-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML file (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=10")
    args = parser.parse_args(argv)
    try:  # every setting checked, against the launch and the files, before anything is built
        # The Slurm job's run dir (slurm/vapo_train.sbatch) only where the file and overrides name none.
        job_run_dir = {"trainer.run_dir": os.environ["VAPO_RUN_DIR"]} if os.environ.get("VAPO_RUN_DIR") else None
        cfg = load_config(args.config, args.overrides, check=False, fallbacks=job_run_dir)
        validate_startup(cfg, world_size=parallel.launcher_env()[1])
        run_config.check_resume(cfg, announce=parallel.launcher_env()[0] == 0)  # vs. run_dir/config.yaml
    except ConfigError as e:
        print(f"vapo-train: configuration error: {e}", file=sys.stderr)
        return 2
    if parallel.launcher_env()[0] == 0:
        run_config.save(cfg)
    stop = StopSignals().install()  # before any other thread or helper process exists
    try:
        trainer = Trainer(cfg, stop)
    except (PromptDataError, ConfigError, CheckpointCorrupt) as e:  # before any training step
        kind = {PromptDataError: "data", ConfigError: "configuration", CheckpointCorrupt: "checkpoint"}[type(e)]
        print(f"vapo-train: {kind} error: {e}", file=sys.stderr, flush=True)
        parallel.destroy()
        return 2
    try:
        code = trainer.run()
    except NonFiniteError as e:  # raised on every rank at the same step (the decision is collective)
        if parallel.is_rank0():
            print(f"vapo-train: numerical error: {e}", file=sys.stderr, flush=True)
        code = NON_FINITE_EXIT_CODE
    finally:
        trainer.close()
        parallel.destroy()
    return code


if __name__ == "__main__":
    sys.exit(main())
