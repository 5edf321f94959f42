"""Stop before the job's time limit, whatever a step costs.

A signal ahead of the time limit (`--signal=USR1@T`) gives a fixed lead, and the trainer can act
on it only at the end of a step; a 32B step takes about half an hour on 8 x 8 H100 (vapo-plan
--gpu h100 predicts 31 min at a mean response of 5,120 tokens, more as responses grow) and a
checkpoint of actor and critic (bf16 weights, fp32 master copy and Adam state) is about 0.9 TB.
So the trainer itself knows when the job ends and decides, before each step, whether that step
and a checkpoint still fit (the idea of NeMo-RL's `checkpoint_must_save_by`): if not, it saves
now and exits for a requeue.

    fits(now, end, step_s, save_s, margin_s)   the decision, pure
    StepClock                                  the longest step and save measured in this process;
                                               until one is measured, the one predicted for this
                                               config and GPU (sizing/step_config.py)
    Deadline.from_setting(trainer.deadline)    where the end time comes from: the Slurm job
                                               (squeue, the one call to Slurm here), a fixed time, or none
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

from vapo_megatron.config.checks import parse_time


def fits(*, now: float, end: float, step_s: float, save_s: float, margin_s: float) -> bool:
    """Do one more step, then a checkpoint, then `margin_s` (exit, requeue, a step longer than
    any seen so far) end before `end`? Times in seconds since the epoch, durations in seconds."""
    return now + step_s + save_s + margin_s <= end


@dataclass
class StepClock:
    """The longest step and the longest checkpoint save measured in this process, in seconds.
    The longest, not the mean: step times follow the response lengths, which grow during RL.
    Until one is measured the prediction stands in (vapo-plan's step-time model for this config
    and GPU: sizing/step_config.py predicted_step_and_save; 0 where it has no rates for the GPU,
    and then the first save of a job is covered by the margin alone)."""

    step_s: float = 0.0
    save_s: float = 0.0
    predicted_step_s: float = 0.0
    predicted_save_s: float = 0.0

    def add_step(self, seconds: float) -> None:
        self.step_s = max(self.step_s, seconds)

    def add_save(self, seconds: float) -> None:
        self.save_s = max(self.save_s, seconds)

    @property
    def next_step_s(self) -> float:
        """What the deadline counts for the next step: the longest measured, else the prediction."""
        return self.step_s or self.predicted_step_s

    @property
    def next_save_s(self) -> float:
        return self.save_s or self.predicted_save_s

    def said(self, what: str) -> str:
        """Where the deadline's figure for `what` ("step" or "save") comes from, for its message."""
        measured, predicted = ((self.step_s, self.predicted_step_s) if what == "step"
                               else (self.save_s, self.predicted_save_s))
        if measured or not predicted:
            return f"longest so far {measured:.0f} s"
        return f"predicted {predicted:.0f} s, none measured yet"


def slurm_end_time(job_id: str) -> float | None:
    """The job's current end time from Slurm (`squeue -o %e`; it follows `scontrol update
    TimeLimit`). None when the job has no time limit or Slurm does not answer (a warning says so)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"[vapo] warning: deadline: cannot ask Slurm for job {job_id}'s end time ({e}); relying on "
              "the USR1 signal", file=sys.stderr, flush=True)
        return None
    if out.returncode != 0:
        print(f"[vapo] warning: deadline: squeue -j {job_id} failed ({out.stderr.strip()}); relying on the "
              "USR1 signal", file=sys.stderr, flush=True)
        return None
    return parse_time(out.stdout)


@dataclass(frozen=True)
class Deadline:
    """Where the end time comes from: `fixed` (seconds since the epoch), else the Slurm job
    `slurm_job` (queried at every check, so a changed time limit counts), else no deadline."""

    margin_s: float
    fixed: float | None = None
    slurm_job: str | None = None

    @classmethod
    def from_setting(cls, setting: str, margin_s: float, env=os.environ) -> "Deadline":
        """trainer.deadline: "slurm" (the job's end time inside a Slurm job, none outside), "none",
        or an ISO-8601 time (config.py checks that it parses)."""
        if setting == "none":
            return cls(margin_s)
        if setting == "slurm":
            return cls(margin_s, slurm_job=env.get("SLURM_JOB_ID") or None)
        return cls(margin_s, fixed=parse_time(setting))

    def end(self) -> float | None:
        if self.fixed is not None:
            return self.fixed
        return slurm_end_time(self.slurm_job) if self.slurm_job else None

    def next_step_fits(self, clock: StepClock) -> tuple[bool, str]:
        """(fits, why): whether one more step and a save fit before the end; `why` explains a no."""
        end = self.end()
        if end is None:
            return True, ""
        now = time.time()
        step_s, save_s = clock.next_step_s, clock.next_save_s
        ok = fits(now=now, end=end, step_s=step_s, save_s=save_s, margin_s=self.margin_s)
        why = (f"{end - now:.0f} s left before the job's end; the next step ({clock.said('step')}) "
               f"+ a checkpoint ({clock.said('save')}) + trainer.deadline_margin_s={self.margin_s:g} "
               f"do not fit (a USR1 backstop needs a lead of at least {step_s + save_s:.0f} s)")
        return ok, "" if ok else why
