"""Answers for majority voting (maj@K): what each response answered, and which answers agree.

Per reward spec (the same specs as training, rewards/__init__.py):
- ``"math"``: math-verify extracts the final answer exactly as the reward parses it (boxed first,
  then other LaTeX, then a plain expression) and decides equality (so ``\\frac{1}{2}`` and ``0.5``
  vote together). Both run in a BoundedPool, under the reward's hard time bound; a check that
  times out or fails counts as "no answer" / "not equal".
- ``"exact"`` and user ``"module:function"`` rewards: the stripped response is the answer and
  equality is string equality (a user function's notion of "the answer" is not known here).
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

from vapo_megatron.rewards.math_reward import ANSWER_SPEC
from vapo_megatron.rewards.pool import BoundedPool


class AnswerKey:
    def __init__(self, spec: str, *, timeout_s: float, num_workers: int = min(4, os.cpu_count() or 1)):
        self.math = spec == "math"
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self._pool: BoundedPool | None = None  # started at first use: most ranks never vote

    def _run(self, tasks: list[tuple[str, str, str]]) -> list:
        if not tasks:
            return []
        if self._pool is None:
            self._pool = BoundedPool(ANSWER_SPEC, num_workers=self.num_workers, timeout_s=self.timeout_s)
        return [o.value if o.error_kind is None and not o.timed_out else None for o in self._pool.run(tasks)]

    def extract(self, responses: Sequence[str]) -> list[str | None]:
        if not self.math:
            return [r.strip() or None for r in responses]
        return self._run([("extract", r, "") for r in responses])

    def equivalence(self, groups: Sequence[Sequence[str | None]]) -> Callable[[str, str], bool]:
        """`same(a, b)` for answers of the same group (one prompt's answers): every pair of
        distinct answers within a group is checked up front, in one batch over all groups."""
        if not self.math:
            return str.__eq__
        pairs: list[tuple[str, str]] = []
        for answers in groups:
            distinct = list(dict.fromkeys(a for a in answers if a))
            pairs += [(x, y) for i, x in enumerate(distinct) for y in distinct[i + 1:]]
        pairs = list(dict.fromkeys(pairs))
        equal = {p for p, ok in zip(pairs, self._run([("same", x, y) for x, y in pairs])) if ok is True}

        def same(a: str, b: str) -> bool:
            return a == b or (a, b) in equal or (b, a) in equal

        return same

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
