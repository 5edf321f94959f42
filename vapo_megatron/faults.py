"""TEST-ONLY fault injection: the crash-consistency and numerics tests kill or poison a real run
at named points. Without the environment variable VAPO_FAULT every function here is a no-op
(one dictionary lookup), so production runs are unaffected.

    VAPO_FAULT="point@N[,point@N...]"

fires `point` while the trainer works on iteration N (0-based: the step that the metrics log as
step N+1; a checkpoint point fires while writing the checkpoint saved right after that step).
Every rank fires at the same point, as a whole-job crash would (after a barrier: fault_point).

Kill points (the process SIGKILLs itself: no handler, no cleanup, no flush):
    rollout          after the rollout engine returned its samples
    critic_update    after the first critic optimizer step of the iteration
    actor_update     after the first actor optimizer step of the iteration
    weight_sync      after the new actor weights were streamed into the rollout engine
    checkpoint       after the actor's dist checkpoint is written, before the critic's
Poison points (queried with `poisoned`):
    nan_loss         the iteration's advantages and returns are NaN, so the actor and critic
                     losses and gradients are NaN (train.py)
Signal points (`fault_point` sends the signal to this process and goes on):
    usr1             SIGUSR1 after the rollout, as Slurm's --signal=USR1@T sends it mid-step
"""

from __future__ import annotations

import os
import signal

KILL_POINTS = ("rollout", "critic_update", "actor_update", "weight_sync", "checkpoint")
POISON_POINTS = ("nan_loss",)
SIGNAL_POINTS = {"usr1": signal.SIGUSR1}

_iteration = -1  # published by the trainer (set_iteration); -1 before the first RL step


def set_iteration(iteration: int) -> None:
    """The trainer publishes the iteration it is working on (its fault points read it)."""
    global _iteration
    _iteration = iteration


def _armed(point: str) -> bool:
    spec = os.environ.get("VAPO_FAULT", "")
    if not spec:
        return False
    for item in spec.split(","):
        name, sep, when = item.strip().partition("@")
        if not sep or not when.isdigit() or name not in KILL_POINTS + POISON_POINTS + tuple(SIGNAL_POINTS):
            raise ValueError(f"VAPO_FAULT={spec!r}: {item!r} is not point@iteration with point one of "
                             f"{', '.join(KILL_POINTS + POISON_POINTS + tuple(SIGNAL_POINTS))}")
        if name == point and int(when) == _iteration:
            return True
    return False


def fault_point(point: str) -> None:
    """SIGKILL this process if VAPO_FAULT names `point` at the current iteration (a signal point:
    send that signal instead).

    Every rank announces its kill, then waits at a barrier until all ranks have announced, then
    kills itself. Without the barrier the first rank to die could take down a peer that was still
    a few instructions behind: the peer, still reading the last collective's data, saw the
    connection reset (or hung on it until torchrun's SIGKILL 30 s later) and never reached its own
    announcement; on a loaded machine that lag is long enough to matter. The barrier's own failure,
    when a faster peer is already gone, is ignored: the kill follows regardless."""
    if point in SIGNAL_POINTS:
        if _armed(point):
            os.kill(os.getpid(), SIGNAL_POINTS[point])
        return
    if _armed(point):
        print(f"[vapo] VAPO_FAULT: killing rank {os.environ.get('RANK', '0')} at {point}@{_iteration}", flush=True)
        try:
            import torch.distributed as dist

            from vapo_megatron import parallel

            if dist.is_available() and dist.is_initialized():
                parallel.barrier()
        finally:
            os.kill(os.getpid(), signal.SIGKILL)


def poisoned(point: str) -> bool:
    """Whether VAPO_FAULT asks to poison `point` at the current iteration."""
    return _armed(point)
