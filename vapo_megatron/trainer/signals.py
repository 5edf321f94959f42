"""Stop requests from the launcher or the user: SIGUSR1, SIGTERM and SIGINT (Ctrl-C).

SIGUSR1 comes from Slurm before a time limit (`--signal=USR1@T`) or by hand (`scancel
--signal=USR1`); SIGTERM from preemption, scancel, or torchrun shutting its workers down. The
trainer only records the signal here and acts on it at its next safe point (the end of a step):
checkpoint, then exit with PREEMPTED_EXIT_CODE; after SIGUSR1 it also asks the launcher for a
requeue (`request_requeue`, slurm/vapo_train.sbatch). A SIGUSR1 during the final step finishes the run.

Why SIGUSR1 is blocked, not just handled: Slurm delivers it to every process of the job step,
the trainer's helper processes included: reward workers, SGLang's processes, and megatron's
checkpoint writer when it has one (a multiprocessing Manager spawned at the first save; since
checkpoint/dist_io.py's write_dist_checkpoint gives megatron an in-process queue, it has none). A program
started by exec gets the default action back for every handled signal, and the default action of
SIGUSR1 is to terminate; such a checkpoint writer then died and the checkpoint the signal asked
for failed (BrokenPipeError inside dist_checkpointing.save, seen on a local Slurm
cluster).
A blocked signal stays blocked across fork and exec, so helpers started after `install()` never
act on it, while a watcher thread of the trainer takes it with sigwait().

SIGTERM keeps a plain handler: helpers should end on it, and Slurm follows it with SIGKILL after
KillWait (GraceTime for preemption), so a checkpoint on SIGTERM is best effort. Not SGLang's engine
processes: the stop checkpoint's step still needs its engine, so they start with SIGTERM and SIGINT
blocked, and the trainer ends them after the checkpoint (rollout/engine_signals.py
spared_from_stop_signals).

SIGINT (Ctrl-C in the terminal of a single-process `vapo-train`) is handled like SIGTERM: a
checkpoint at the end of the step, exit 3, no requeue. Python's default turned it into a
KeyboardInterrupt wherever the trainer was, with no checkpoint: up to save_every steps lost. A
second Ctrl-C stops at once (KeyboardInterrupt; vapo-train's main ends it in one line, exit 130).
Under torchrun the terminal's Ctrl-C reaches only the agent, which passes SIGINT on to the workers;
torchrun itself then exits 1 whatever their codes (docs/faults.md, "SIGTERM to torchrun itself")."""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from vapo_megatron.mcore import parallel
from vapo_megatron.trainer.deadline import Deadline, StepClock

STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # stop even during the final step, and ask no requeue


class StopSignals:
    """`signum` is 0 until SIGUSR1, SIGTERM or SIGINT arrives, then that signal's number."""

    def __init__(self) -> None:
        self.signum = 0
        self.interrupted = False  # a second Ctrl-C arrived: stop at once

    def install(self) -> "StopSignals":
        """Call first thing in the process, before other threads exist: a thread created
        earlier does not block SIGUSR1, and the kernel may hand the signal to it (the handler
        below still records it then)."""
        # A handler also replaces a SIG_IGN inherited from the launcher (the sbatch script starts
        # torchrun with SIGUSR1 ignored), which would discard the signal.
        signal.signal(signal.SIGUSR1, self._record)
        signal.signal(signal.SIGTERM, self._record)
        signal.signal(signal.SIGINT, self._interrupt)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        threading.Thread(target=self._watch_usr1, name="vapo-sigusr1", daemon=True).start()
        return self

    def _record(self, signum: int, frame) -> None:
        self.signum = signum

    def _interrupt(self, signum: int, frame) -> None:
        if self.signum == signal.SIGINT:  # the second Ctrl-C
            # Raised wherever the main thread is; inside a save, a C-level writer may report it as
            # its own failure instead, so the flag tells vapo-train's main what happened.
            self.interrupted = True
            raise KeyboardInterrupt
        self.signum = signum
        print("\n[vapo] Ctrl-C: stopping after this step with a checkpoint (exit 3); Ctrl-C again stops at once, "
              "without one", file=sys.stderr, flush=True)

    def _watch_usr1(self) -> None:
        while True:
            self.signum = signal.sigwait({signal.SIGUSR1})


def stop_reason(stop: StopSignals, deadline: Deadline, clock: StepClock, *, final: bool) -> str:
    """Collective: why every rank stops after this step, "" to go on. A signal on any rank, or
    rank 0's finding that the next step and a save no longer fit before the deadline. After
    the final step only SIGTERM stops: finishing (final eval, export) beats a requeue that
    would redo them."""
    fits, why = (True, "") if final or not parallel.is_rank0() else deadline.next_step_fits(clock)
    flag = torch.tensor([stop.signum, int(not fits)], dtype=torch.int64)
    parallel.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step (SIGTERM > SIGUSR1)
    signum, late = int(flag[0]), bool(flag[1])
    if signum in STOPPING_SIGNALS or (signum and not final):
        return signal.Signals(signum).name
    if signum and parallel.is_rank0():
        print("[vapo] SIGUSR1 during the final step: finishing the run (final eval, save, export), no requeue",
              flush=True)
    if late:
        if parallel.is_rank0():
            print(f"[vapo] deadline: {why}", flush=True)
        return "deadline"
    return ""


def leave_together() -> None:
    """Collective, after the ranks decided together to end: every rank then exits with its own
    code. Under torchrun the first rank to exit with a non-zero code makes the agent SIGTERM the
    others, and a rank still tearing down died of it (Python restores SIGTERM's default action
    when it shuts down): exit code -15 instead of 3 or 4 (a flaky test_fault_injection run). So
    each rank ignores SIGTERM first, and none passes the barrier before all have."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parallel.barrier()


def request_requeue() -> None:
    """Ask the launcher for a requeue: create the file named by VAPO_REQUEUE_FILE (set by
    slurm/vapo_train.sbatch's per-node shell, which requeues the job when it exists after torchrun
    has exited; torchrun's own exit status does not carry the worker's). No-op without it."""
    path = os.environ.get("VAPO_REQUEUE_FILE")
    if path:
        with open(path, "a"):
            pass
