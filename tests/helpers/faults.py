"""TEST-ONLY fault injection: the crash-consistency and numerics tests kill or poison a real run
at the named boundaries of vapo_megatron/runtime/fault_points.py.

    VAPO_FAULT="point@N[,point@N...]" python -m tests.helpers.faults --config FILE [overrides]

is vapo-train (its main, the same arguments; under torchrun as well) with this module's hook
installed, which fires `point` while the trainer works on iteration N (0-based: the step that the
metrics log as step N+1; a checkpoint point fires while writing the checkpoint saved right after
that step). The hook learns N from the trainer itself: it wraps `Trainer.train_step` to read
`state.iteration` as each step starts (-1 before the first RL step: the SFT warm start). Every rank
fires at the same point, as a whole-job crash would. vapo-train itself never installs the hook:
VAPO_FAULT does nothing there.

Kill points (the process SIGKILLs itself: no handler, no cleanup, no flush):
    rollout          after the rollout engine returned its samples
    critic_update    after the first critic optimizer step of the iteration
    actor_update     after the first actor optimizer step of the iteration
    weight_sync      after the new actor weights were streamed into the rollout engine
    checkpoint       after the actor's dist checkpoint is written, before the critic's
Poison points (queried with `poisoned`):
    nan_loss         every optimizer step of the iteration, both models', sees a non-finite loss
                     (mcore/update.py guarded_step): each is skipped and counted
Signal points (fired at the rollout boundary: the signal goes out and the run goes on):
    usr1             SIGUSR1 after the rollout, as Slurm's --signal=USR1@T sends it mid-step
    term_launcher    SIGTERM after the rollout to the parent of local rank 0 (torchrun's agent under
                     torchrun), as `kill <torchrun's pid>` sends it; the other ranks send nothing
"""

from __future__ import annotations

import os
import signal
import sys

from vapo_megatron import train
from vapo_megatron.runtime import fault_points

ENTRY = "tests.helpers.faults"  # the module to launch (tests/helpers/train_runs.py launch(module=...))
KILL_POINTS = ("rollout", "critic_update", "actor_update", "weight_sync", "checkpoint")
POISON_POINTS = ("nan_loss",)
SIGNAL_POINTS = {"usr1": signal.SIGUSR1, "term_launcher": signal.SIGTERM}
TO_PARENT = ("term_launcher",)  # signal points whose signal goes to the parent process
SIGNALLED_AT = "rollout"  # the boundary every signal point fires at


def armed(point: str, iteration: int) -> bool:
    """Whether VAPO_FAULT names `point` at `iteration` (ValueError naming a malformed item)."""
    spec = os.environ.get("VAPO_FAULT", "")
    if not spec:
        return False
    for item in spec.split(","):
        name, sep, when = item.strip().partition("@")
        if not sep or not when.isdigit() or name not in KILL_POINTS + POISON_POINTS + tuple(SIGNAL_POINTS):
            raise ValueError(f"VAPO_FAULT={spec!r}: {item!r} is not point@iteration with point one of "
                             f"{', '.join(KILL_POINTS + POISON_POINTS + tuple(SIGNAL_POINTS))}")
        if name == point and int(when) == iteration:
            return True
    return False


class FromEnvironment:
    """The fault_points.Hook of VAPO_FAULT. `iteration`: the one the trainer works on (main sets it)."""

    iteration = -1

    def point(self, name: str) -> None:
        """SIGKILL this process if VAPO_FAULT names `name` at `iteration`, after one line on stdout
        saying so (a signal point: send that signal instead).

        The line goes out in ONE write(2). print() writes the text and its newline in two calls, and
        under torchrun (workers run `python -u`, stdout unbuffered) every rank's stdout is one shared
        file: two ranks announcing at the same moment could land as "...rank 0 at rollout@1[vapo]
        VAPO_FAULT: killing rank 1 at rollout@1\\n\\n", which is no longer rank 0's line (the flaky
        tests/test_fault_injection.py failure of issue 13). One write of a short line to a regular
        file or a pipe is not split by another process's write."""
        iteration = self.iteration
        if armed(name, iteration):
            line = f"[vapo] VAPO_FAULT: killing rank {os.environ.get('RANK', '0')} at {name}@{iteration}\n"
            sys.stdout.flush()  # anything printed before goes first
            os.write(sys.stdout.fileno(), line.encode())
            os.kill(os.getpid(), signal.SIGKILL)
        if name == SIGNALLED_AT:
            for sig_point, sig in SIGNAL_POINTS.items():
                if armed(sig_point, iteration) and sig_point not in TO_PARENT:
                    os.kill(os.getpid(), sig)
                elif armed(sig_point, iteration) and os.environ.get("LOCAL_RANK", "0") == "0":
                    os.kill(os.getppid(), sig)

    def poisoned(self, name: str) -> bool:
        return armed(name, self.iteration)


def main(argv: list[str] | None = None) -> int:
    from vapo_megatron.trainer.trainer import Trainer

    hook, step = FromEnvironment(), Trainer.train_step

    def train_step(trainer: Trainer) -> None:  # the iteration a point@N counts, read where the step starts
        hook.iteration = trainer.state.iteration
        step(trainer)

    Trainer.train_step = train_step
    fault_points.install(hook)
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
