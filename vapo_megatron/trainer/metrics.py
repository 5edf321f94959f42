"""Run metrics: one JSON record per step in metrics.jsonl, the same in TensorBoard and, when
trainer.wandb is on, in Weights & Biases (wandb_run.py), and a progress bar. Only global rank 0
writes. Names are namespaced (actor/, critic/, rollout/,
reward/, response_length/, eval/, perf/)."""

from __future__ import annotations

import json
import math
import os

from tqdm import tqdm

from vapo_megatron.runtime.atomic import write_atomic
from vapo_megatron.trainer import timing

# The progress bar's figures: metric -> its label there (every label says what it is).
SFT_SHOWN = {"sft/nll_loss": "nll", "sft/train_accuracy": "train_accuracy"}
RL_SHOWN = {"reward/mean": "reward", "critic/explained_variance": "explained_variance",
            "eval/accuracy": "eval_accuracy"}
# The run's final eval, once per run: when a finished run is extended (a larger trainer.total_steps),
# its earlier final eval's record keeps its figures, its eval/accuracy_final renamed to this.
FINAL, SUPERSEDED_FINAL = "eval/accuracy_final", "eval/accuracy_before_extension"


class MetricsLogger:
    """`start_step`/`sft_start`: the RL iteration and SFT step the run resumes after (0 on a fresh
    start). What a previous attempt logged beyond them is dropped from metrics.jsonl and hidden
    in TensorBoard, so that every step appears once however often the run was resumed."""

    def __init__(self, run_dir: str, *, total_steps: int, start_step: int, sft_start: int, finished: bool,
                 enabled: bool, tensorboard: bool, wandb=None, sft_steps: int = 0):
        self.enabled = enabled
        self.sft_steps = sft_steps  # the warm start's most steps (sft.steps), shown while it runs
        self.wandb = wandb  # a WandbTracker (started by the trainer on rank 0) or None
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb = self.tb_sft = None
        self.bar = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        kept = self._truncate(start_step, sft_start, finished, extended=finished and start_step < total_steps)
        if wandb is not None:  # what a killed attempt logged but W&B never wrote (wandb_run.py)
            wandb.backfill(kept)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard discards the earlier attempts' events from that step on. The
            # SFT curves have their own step counter, hence their own writer (a run of their own).
            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start_step + 1)
            self.tb_sft = SummaryWriter(os.path.join(run_dir, "tensorboard", "sft"), purge_step=sft_start + 1)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="vapo", dynamic_ncols=True)

    def _truncate(self, step: int, sft_step: int, finished: bool, *, extended: bool) -> list[dict]:
        """Keep the records of the steps the run resumes after: RL records up to `step`, SFT
        records up to `sft_step`, the final eval only when the run has finished (else it is done
        again); nothing on a fresh start (a crash before the first checkpoint leaves records that
        the new attempt writes again). `extended`: a finished run trains on, so its final eval is
        not the last: its record is kept with FINAL renamed SUPERSEDED_FINAL. Returns the records kept."""
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            lines = f.readlines()
        if lines and not lines[-1].endswith("\n"):
            lines.pop()  # a record torn by a crash mid-write (its step is redone)
        keep = []
        for line in lines:
            if not line.strip():
                continue
            r = json.loads(line)
            redone = (r["step"] > step or (r["phase"] == "sft" and r.get("sft_step", 0) > sft_step)
                      or (FINAL in r and not finished))
            if not redone and (step > 0 or sft_step > 0):
                if extended and FINAL in r:
                    r[SUPERSEDED_FINAL] = r.pop(FINAL)
                    line = json.dumps(r) + "\n"
                keep.append(line)
        write_atomic(self.path, "".join(keep))
        return [json.loads(line) for line in keep]

    def log(self, step: int, phase: str, metrics: dict[str, float], *, tb_step: int | None = None) -> None:
        """`step` is the RL iteration (what resume truncates on); the warm start logs at 0 and
        passes its own step counter as `tb_step` so its TensorBoard curves have an x axis."""
        if not self.enabled:
            return
        record = {"step": step, "phase": phase} | ({"sft_step": tb_step} if phase == "sft" else {})
        record.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                       for k, v in sorted(metrics.items())})
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        tb = self.tb_sft if phase == "sft" else self.tb
        if tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    tb.add_scalar(k, v, step if tb_step is None else tb_step)
            tb.flush()
        if self.wandb is not None:
            self.wandb.log(step, metrics)
        if self.bar is not None and phase == "sft":  # the bar counts RL iterations; its label, the warm start's steps
            self.bar.set_description(f"warm start {tb_step}/{self.sft_steps}, then RL", refresh=False)
            self.bar.set_postfix({label: f"{metrics[k]:.3f}" for k, label in SFT_SHOWN.items() if k in metrics})
        elif self.bar is not None and phase not in ("eval", "data"):
            self.bar.set_description("vapo", refresh=False)
            self.bar.update(1)
            postfix = {label: f"{metrics[k]:.3f}" for k, label in RL_SHOWN.items() if k in metrics}
            if "perf/step_s" in metrics:  # the step time and its largest phases (timing.py)
                postfix["time"] = timing.summary(metrics)
            self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        for tb in (self.tb, self.tb_sft):
            if tb is not None:
                tb.close()
        if self.bar is not None:
            self.bar.close()
