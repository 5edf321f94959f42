"""Run metrics: one JSON record per step in metrics.jsonl, the same in TensorBoard, and a
progress bar. Only global rank 0 writes. Names are namespaced (actor/, critic/, rollout/,
reward/, response_length/, eval/, perf/)."""

from __future__ import annotations

import json
import math
import os

from tqdm import tqdm

from vapo_megatron.checkpoint.atomic import write_atomic
from vapo_megatron.trainer import timing


class MetricsLogger:
    def __init__(self, run_dir: str, *, total_steps: int, start_step: int, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb = None
        self.bar = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self.bar = tqdm(total=total_steps, initial=start_step, desc="vapo", dynamic_ncols=True)

    def truncate_after(self, step: int) -> None:
        """On resume, drop records of steps after the checkpoint (they will be redone)."""
        if not self.enabled or not os.path.exists(self.path):
            return
        with open(self.path) as f:
            lines = f.readlines()
        if lines and not lines[-1].endswith("\n"):
            lines.pop()  # a record torn by a crash mid-write (its step is redone)
        keep = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        write_atomic(self.path, "".join(keep))

    def log(self, step: int, phase: str, metrics: dict[str, float], *, tb_step: int | None = None) -> None:
        """`step` is the RL iteration (what resume truncates on); the warm start logs at 0 and
        passes its own step counter as `tb_step` so its TensorBoard curves have an x axis."""
        if not self.enabled:
            return
        record = {"step": step, "phase": phase}
        record.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in sorted(metrics.items())})
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step if tb_step is None else tb_step)
            self.tb.flush()
        if self.bar is not None and phase == "sft":  # the bar counts RL iterations only
            self.bar.set_description(f"sft step {tb_step}", refresh=False)
            self.bar.set_postfix({k.split("/")[-1]: f"{v:.3f}" for k, v in metrics.items() if k in ("sft/nll_loss", "sft/train_accuracy")})
        elif self.bar is not None and phase not in ("eval", "data"):
            self.bar.set_description("vapo", refresh=False)
            self.bar.update(1)
            shown = {k: metrics[k] for k in ("reward/mean", "critic/explained_variance", "eval/accuracy") if k in metrics}
            postfix = {k.split("/")[-1]: f"{v:.3f}" for k, v in shown.items()}
            if "perf/step_s" in metrics:  # the step time and its largest phases (timing.py)
                postfix["time"] = timing.summary(metrics)
            self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()
