"""Two layouts of megatron-core on the same ranks: the actor's and the critic's own (critic.parallel).

megatron-core keeps one layout's process groups in parallel_state's module globals; its layers,
DDP, optimizer, schedules, finalize_model_grads and dist checkpointing read them (at construction
or per call), as do mcore/parallel.py's helpers. For a critic at its own TP/PP/EP, parallel.py's
init_distributed runs megatron's initialize_model_parallel once for the critic (new torch groups
over the same ranks), keeps those globals as the critic's role, puts the pristine values back and
initializes the actor's. `with role("critic"):` swaps the critic's globals in for what runs inside
(its build, forwards, updates, checkpoints) and the actor's back after: every call into the critic
runs in such a block (mcore/critic.py, checkpoint/), so what megatron built into the critic and
what it asks per call are the same groups. Both roles' groups exist on every rank, so every rank
makes the same collectives in the same order. Without critic.parallel (or at the actor's layout)
there is one role, `role("critic")` is the actor's, nothing is swapped: the run is bitwise today's.
"""

from __future__ import annotations

_ROLES: dict = {}
_ACTIVE: list[tuple[str, str]] = []  # (role entered, role to go back to)


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def snapshot() -> dict:
    """parallel_state's module globals (its groups, ranks, sizes and caches): every `_UPPER` name."""
    return {k: v for k, v in vars(_ps()).items() if k.startswith("_") and k[1:2].isupper()}


def restore(state: dict) -> None:
    vars(_ps()).update(state)


def _current() -> str:
    return _ACTIVE[-1][0] if _ACTIVE else "actor"


class Role:
    """One layout's megatron state; `with` enters it (nothing to do when it is the current one),
    and puts the previous one back after."""

    def __init__(self, name: str, state: dict):
        self.name, self.state = name, state

    def __enter__(self):
        here = _current()
        if here != self.name:
            _ROLES[here].state = snapshot()  # the live state: megatron may have filled lazy caches
            restore(self.state)
        _ACTIVE.append((self.name, here))
        return self

    def __exit__(self, *exc) -> None:
        name, back = _ACTIVE.pop()
        if back != name:
            self.state = snapshot()
            restore(_ROLES[back].state)


def keep(name: str) -> None:
    """The current megatron state as role `name` (parallel.init_distributed, after initializing it)."""
    _ROLES[name] = Role(name, snapshot())


def clear() -> None:
    if _current() != "actor":
        raise RuntimeError("parallel.destroy() inside `with role('critic')`")
    _ROLES.clear()
    _ACTIVE.clear()


def role(name: str) -> Role:
    """`with role("critic"):` runs its block at the critic's layout (the actor's when the critic
    has none of its own); `role("actor")` the actor's. Nested or repeated entries are fine."""
    if name not in ("actor", "critic"):
        raise ValueError(f"parallel.role({name!r}): 'actor' or 'critic'")
    if not _ROLES:
        raise RuntimeError("init_distributed() has not run (no roles)")
    return _ROLES.get(name, _ROLES["actor"])


def own_layout(name: str) -> bool:
    """Whether role `name` has process groups of its own (the critic at critic.parallel)."""
    return name in _ROLES and name != "actor"


__all__ = ["Role", "clear", "keep", "own_layout", "restore", "role", "snapshot"]
