"""Rewards: verifiers and user reward functions behind one batch interface.

Reward specs (``build_reward_fn(spec, ...)``):
- ``"math"``: math-verify (rewards/math_reward.py), in a process pool with a hard per-check
  time bound.
- ``"exact"``: the stripped response equals the stripped ground truth (the demo's task).
- ``"package.module:function"``: a user function, resolved with importlib, called as
  ``fn(prompt: str, response: str, ground_truth: str) -> float | bool`` inside the same
  time-bounded pool (so it must be importable by a fresh Python process). If the function
  has a callable ``warmup`` attribute, each worker calls it once before taking tasks.
  A ``bool`` maps to ``correct_score`` / ``incorrect_score``. A number is used as the score
  as is, and the sample counts as correct (for VAPO's positive-example LM loss, paper
  section 4.3) when the number is >= ``correct_score``. If the function raises, returns
  something else (None, a string, NaN), or runs past ``timeout_s``, the sample gets
  ``incorrect_score``, the failure is counted (reward/errors; reward/timeouts for the time
  bound), the first failure of each exception kind is logged with its traceback, and the
  run continues. This holds for any exception, SystemExit and KeyboardInterrupt included,
  and for a worker that dies outright (kind ``WorkerDied``; it is replaced).

``score(response, ground_truth)``: one response checked with math-verify, over a shared pool.

Beside it: scorer.py (step 3 of the loop: a rollout's rewards as batch tensors) and shaping.py
(DAPO's overlong reward shaping, added to the verifier's score in the training batch only).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from typing import TYPE_CHECKING, Protocol

from vapo_megatron.rewards.math_reward import MATH_SPEC, RewardResult
from vapo_megatron.rewards.pool import BoundedPool, Outcome, resolve_function

if TYPE_CHECKING:
    import torch

__all__ = ["RewardFn", "RewardResult", "PoolRewardFn", "ExactMatchRewardFn", "build_reward_fn", "score", "score_batch",
           "summarize"]

logger = logging.getLogger(__name__)


class RewardFn(Protocol):
    """Scores a batch: one RewardResult per (prompt, response, ground_truth)."""

    def __call__(self, prompts: list[str], responses: list[str], ground_truths: list[str]) -> list[RewardResult]: ...


class ExactMatchRewardFn:
    """Exact string match after stripping surrounding whitespace."""

    def __init__(self, *, correct_score: float, incorrect_score: float):
        self.correct_score = correct_score
        self.incorrect_score = incorrect_score

    def __call__(self, prompts: list[str], responses: list[str], ground_truths: list[str]) -> list[RewardResult]:
        out = []
        for r, g in zip(responses, ground_truths, strict=True):
            ok = r.strip() == g.strip()
            out.append(RewardResult(score=self.correct_score if ok else self.incorrect_score, correct=ok))
        return out

    def wait_ready(self) -> None:
        pass

    def close(self) -> None:
        pass


class PoolRewardFn:
    """A ``"module:function"`` check run in a BoundedPool (hard per-call bound of timeout_s)."""

    def __init__(self, spec: str, *, correct_score: float, incorrect_score: float, timeout_s: float, num_workers: int):
        resolve_function(spec)  # fail now, in this process, with the spec named
        self.spec = spec
        self.correct_score = correct_score
        self.incorrect_score = incorrect_score
        self._pool = BoundedPool(spec, num_workers=num_workers, timeout_s=timeout_s)
        self._logged_kinds: set[str] = set()

    def _result(self, o: Outcome) -> RewardResult:
        fail = self.incorrect_score
        if o.timed_out:
            if "Timeout" not in self._logged_kinds:
                self._logged_kinds.add("Timeout")
                logger.warning("reward check %s ran past its bound of %gs: scored %g and counted under "
                               "reward/timeouts (logged once)", self.spec, self._pool.timeout_s, fail)
            return RewardResult(score=fail, correct=False, timed_out=True)
        if o.error_kind is not None:
            if o.error_kind not in self._logged_kinds:
                self._logged_kinds.add(o.error_kind)
                logger.error("reward function %s raised %s (logged once per kind): %s\n%s",
                             self.spec, o.error_kind, o.error, o.traceback or "")
            return RewardResult(score=fail, correct=False, error=f"{o.error_kind}: {o.error}")
        v = o.value
        if isinstance(v, bool):
            return RewardResult(score=self.correct_score if v else fail, correct=v)
        if isinstance(v, numbers.Real) and math.isfinite(v):  # int, float, numpy scalars, Fraction
            return RewardResult(score=float(v), correct=float(v) >= self.correct_score)
        kind = "BadReturn"
        if kind not in self._logged_kinds:
            self._logged_kinds.add(kind)
            logger.error("reward function %s returned %r (expected float or bool; logged once)", self.spec, v)
        return RewardResult(score=fail, correct=False, error=f"{kind}: {type(v).__name__} {v!r}"[:200])

    def __call__(self, prompts: list[str], responses: list[str], ground_truths: list[str]) -> list[RewardResult]:
        if not (len(prompts) == len(responses) == len(ground_truths)):
            raise ValueError(f"batch sizes differ: {len(prompts)} prompts, {len(responses)} responses, "
                             f"{len(ground_truths)} answers")
        outcomes = self._pool.run(list(zip(prompts, responses, ground_truths)))
        return [self._result(o) for o in outcomes]

    def wait_ready(self) -> None:
        """Block until all workers have imported and warmed up (call once at start-up)."""
        self._pool.wait_ready()

    def close(self) -> None:
        self._pool.close()


def build_reward_fn(
    spec: str,
    *,
    correct_score: float,
    incorrect_score: float,
    timeout_s: float,
    num_workers: int = min(4, os.cpu_count() or 1),
) -> RewardFn:
    """``"math"``, ``"exact"`` or ``"package.module:function"`` (see the module docstring)."""
    if correct_score <= incorrect_score:
        raise ValueError(f"correct_score ({correct_score}) must be greater than incorrect_score ({incorrect_score})")
    if spec == "exact":
        return ExactMatchRewardFn(correct_score=correct_score, incorrect_score=incorrect_score)
    target = MATH_SPEC if spec == "math" else spec
    return PoolRewardFn(target, correct_score=correct_score, incorrect_score=incorrect_score,
                        timeout_s=timeout_s, num_workers=num_workers)


_DEFAULT_POOLS: dict[float, object] = {}


def score(
    response_text: str,
    ground_truth: str,
    *,
    correct_score: float = 1.0,
    incorrect_score: float = -1.0,
    timeout_s: float = 5.0,
) -> RewardResult:
    """Score one response with math-verify over a shared default pool of one worker per bound
    (paper: +1 correct, -1 wrong; 0/1 works too). A check that runs past ``timeout_s`` (wall
    clock, hard) scores ``incorrect_score`` with ``timed_out=True``."""
    fn = _DEFAULT_POOLS.get(timeout_s)
    if fn is None:
        fn = _DEFAULT_POOLS[timeout_s] = PoolRewardFn(
            MATH_SPEC, correct_score=1.0, incorrect_score=0.0, timeout_s=timeout_s, num_workers=1
        )
    (r,) = fn([""], [response_text], [ground_truth])
    return RewardResult(
        score=correct_score if r.correct else incorrect_score, correct=r.correct, timed_out=r.timed_out, error=r.error
    )


def score_batch(
    reward_fn: RewardFn, prompts: list[str], responses: list[str], ground_truths: list[str]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Returns scores float32 [B], correct bool [B], and counters for logging:
    reward/mean, reward/accuracy, reward/timeouts, reward/errors (the last two are counts)."""
    import torch  # noqa: F401  (here, not at the top: reward workers import this package and need no torch)

    return summarize(reward_fn(prompts, responses, ground_truths))


def summarize(results: list) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """score_batch's tensors and counters from a list of RewardResults."""
    import torch

    scores = torch.tensor([r.score for r in results], dtype=torch.float32)
    correct = torch.tensor([r.correct for r in results], dtype=torch.bool)
    n = max(len(results), 1)
    counters = {
        "reward/mean": float(scores.sum()) / n,
        "reward/accuracy": float(correct.sum()) / n,
        "reward/timeouts": float(sum(r.timed_out for r in results)),
        "reward/errors": float(sum(r.error is not None for r in results)),
    }
    return scores, correct, counters
