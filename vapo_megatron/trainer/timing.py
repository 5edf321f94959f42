"""Where a step's time goes: wall seconds per phase, logged every step as perf/<phase>_s
(the split verl logs as timing_s/*, NeMo-RL as timing/*).

    timer = PhaseTimer()
    timer.start()
    while ...:
        with timer("rollout"):
            ...
        logs = timer.lap()   # perf/rollout_s, ..., perf/other_s, perf/step_s; the next step starts

perf/step_s is the wall time between two laps, so the records of a run add up to its wall time
(from the first start() on) and nothing is counted twice; perf/other_s is what no named phase
covers (advantages, logging, the collectives between phases). The trainer logs a step's record
before the checkpoint that may follow it (a checkpoint must never hold a step whose metrics are
not on disk), so the eval and checkpoint run after step N are in step N+1's record.
On CUDA every boundary waits for the device (torch.cuda.synchronize): kernels are asynchronous,
and without the wait a phase's time would be charged to whichever later phase first blocks on
its results.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

# The named phases of a step, in the order they run; each is logged as perf/<name>_s, 0 when a
# step did not run it (no actor update while value pretraining, no checkpoint after most steps).
# offload/onload: the trainer's state to host memory and back around the rollout
# (trainer.offload_during_rollout, mcore/offload.py).
PHASES = ("offload", "rollout", "onload", "reward", "score", "critic_update", "actor_update", "sync", "eval",
          "checkpoint")


def _device_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseTimer:
    """`absent`: phases this run does not have (a run without a critic has no critic update): not
    logged at all, and a block timed under one counts in perf/other_s."""

    def __init__(self, absent: tuple[str, ...] = ()) -> None:
        if unknown := [p for p in absent if p not in PHASES]:
            raise KeyError(f"unknown phases {unknown}; phases: {', '.join(PHASES)}")
        self.phases = tuple(p for p in PHASES if p not in absent)
        self._spent = dict.fromkeys(self.phases, 0.0)
        self._t0: float | None = None

    def start(self) -> None:
        _device_sync()
        self._spent = dict.fromkeys(self.phases, 0.0)
        self._t0 = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str):
        if phase not in PHASES:
            raise KeyError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        if phase not in self._spent:  # absent from this run
            yield
            return
        _device_sync()
        t = time.perf_counter()
        try:
            yield
        finally:
            _device_sync()
            self._spent[phase] += time.perf_counter() - t

    def lap(self) -> dict[str, float]:
        """The times since start() or the previous lap, as perf/* metrics; starts the next lap."""
        if self._t0 is None:
            raise RuntimeError("lap() before start()")
        _device_sync()
        now = time.perf_counter()
        step, spent = now - self._t0, self._spent
        self._spent, self._t0 = dict.fromkeys(self.phases, 0.0), now
        logs = {f"perf/{name}_s": s for name, s in spent.items()}
        logs["perf/other_s"] = max(step - sum(spent.values()), 0.0)
        logs["perf/step_s"] = step
        return logs


def summary(logs: dict[str, float], top: int = 3) -> str:
    """The step time and its largest phases for the progress bar: '2.41s roll 52% actor 21% crit 12%',
    then the offload and onload times whenever the trainer moved its state: '... off 0.81s on 0.93s'."""
    step = logs.get("perf/step_s")
    if not step:
        return ""
    short = {"rollout": "roll", "critic_update": "crit", "actor_update": "actor", "checkpoint": "ckpt"}
    parts = sorted(((logs[f"perf/{p}_s"], p) for p in (*PHASES, "other")
                    if logs.get(f"perf/{p}_s") and p not in ("offload", "onload")), reverse=True)
    moves = "".join(f" {label} {logs[f'perf/{p}_s']:.2f}s" for p, label in (("offload", "off"), ("onload", "on"))
                    if logs.get(f"perf/{p}_s"))
    return f"{step:.2f}s " + " ".join(f"{short.get(p, p)} {100 * s / step:.0f}%" for s, p in parts[:top]) + moves
