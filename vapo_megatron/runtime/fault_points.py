"""The boundaries of a run where a test can step in: the crash-consistency and numerics tests'
fault points (docs/faults.md, "Crashes and kills").

    point(name)      a boundary a test may kill the run at, or signal it from:
                       rollout        the generator, when the step's rollout is done (release_weights)
                       weight_sync    the generator, after the actor's weights reached the engines
                       critic_update  the optimizer step, after each of the critic's steps
                       actor_update   the optimizer step, after each of the actor's steps
                       checkpoint     the checkpoint manager, after the actor's part is written
    poisoned(name)   whether a test makes this boundary's input non-finite: `nan_loss` at the
                     optimizer step (its losses count as NaN, so the step is skipped and counted)
    install(hook)    a test's Hook; only the tests' entry point installs one (docs/faults.md)

Why the package names them at all: the tests prove that a run killed mid-update, between the
actor's and the critic's part of a checkpoint or after the weight sync resumes to the same run,
and only the code at those boundaries knows where they are; a real run (torchrun, every rank) is
killed there, so nothing outside the process can do it. Only three owners call this module (the
generator, the optimizer step, the checkpoint manager), never the training step: which iteration
a point is at is the hook's business (the tests' hook reads it from the trainer). Without a hook
every call reads one global and does nothing.
"""

from __future__ import annotations

from typing import Protocol


class Hook(Protocol):
    def point(self, name: str) -> None: ...

    def poisoned(self, name: str) -> bool: ...


_hook: Hook | None = None


def install(hook: Hook | None) -> None:
    global _hook
    _hook = hook


def point(name: str) -> None:
    if _hook is not None:
        _hook.point(name)


def poisoned(name: str) -> bool:
    return _hook is not None and _hook.poisoned(name)


__all__ = ["Hook", "install", "point", "poisoned"]
