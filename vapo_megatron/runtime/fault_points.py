"""The named points of a run where a test can step in: the crash-consistency and numerics tests'
fault points (docs/faults.md, "Crashes and kills").

    set_iteration(n)   the trainer: the iteration it is working on (the N of a test's point@N)
    point(name)        a place where a test may kill the run or signal it: rollout, critic_update,
                       actor_update, weight_sync, checkpoint, usr1, term_launcher
    poisoned(name)     whether a test asks for `name` (nan_loss) to be poisoned at this iteration
    install(hook)      a test's Hook; the tests' entry point tests/helpers/faults.py installs one

Why the package names them at all: the tests prove that a run killed mid-update, between the
actor's and the critic's part of a checkpoint or after the weight sync resumes to the same run,
and only the code at those places knows where they are; a real run (torchrun, every rank) is
killed there, so nothing outside the process can do it. The hook is the tests': it is installed
by their entry point (`python -m tests.helpers.faults`, vapo-train with $VAPO_FAULT's faults),
never by the package, so without it every call here reads one global and does nothing.
"""

from __future__ import annotations

from typing import Protocol


class Hook(Protocol):
    def point(self, name: str, iteration: int) -> None: ...

    def poisoned(self, name: str, iteration: int) -> bool: ...


_hook: Hook | None = None
_iteration = -1  # published by the trainer (set_iteration); -1 before the first RL step


def install(hook: Hook | None) -> None:
    global _hook
    _hook = hook


def set_iteration(iteration: int) -> None:
    global _iteration
    _iteration = iteration


def point(name: str) -> None:
    if _hook is not None:
        _hook.point(name, _iteration)


def poisoned(name: str) -> bool:
    return _hook is not None and _hook.poisoned(name, _iteration)


__all__ = ["Hook", "install", "point", "poisoned", "set_iteration"]
