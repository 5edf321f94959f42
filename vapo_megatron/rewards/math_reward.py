"""Math answers checked with math-verify (boxed answers, LaTeX, plain numbers), time-bounded.

``math_equal`` is the check itself; it runs inside a ``BoundedPool`` worker (rewards/pool.py),
so math-verify's signal-based timeouts are switched off and the parent's hard deadline is
the bound. ``score`` (rewards/__init__.py) is the one-call convenience form over a shared
default pool.
"""

from __future__ import annotations

from dataclasses import dataclass

# Only the tail of a response is parsed: the final answer sits at the end of a chain of
# thought, and a cap keeps a megabyte of rambling from reaching the LaTeX parser.
MAX_RESPONSE_CHARS = 8192
MATH_SPEC = "vapo_megatron.rewards.math_reward:math_equal"


@dataclass(frozen=True)
class RewardResult:
    score: float
    correct: bool
    timed_out: bool = False
    error: str | None = None  # "ExceptionType: message" when the check or user function failed


def math_equal(prompt: str, response: str, ground_truth: str) -> bool:
    """True when the response's final answer equals ``ground_truth`` per math-verify.

    The gold answer is parsed as the content of a ``\\boxed{}`` (DAPO ground truths are bare
    LaTeX like ``\\frac{1}{2}`` or ``34``); the response is searched for a boxed answer
    first, then other LaTeX, then a plain expression/number. ``prompt`` is unused.
    """
    import logging

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # The bound is the pool's hard deadline; silence math-verify's "timeout disabled" notice.
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    gold = parse(
        "\\boxed{" + ground_truth + "}",
        [LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=None,
    )
    if not gold:
        gold = [ground_truth.strip()]
    pred = parse(
        response[-MAX_RESPONSE_CHARS:],
        [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
        parsing_timeout=None,
    )
    if not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def _warmup() -> None:
    math_equal("", "so \\boxed{\\frac{1}{2}} or 0.5", "\\frac{1}{2}")  # imports sympy, builds the LaTeX parser


math_equal.warmup = _warmup  # type: ignore[attr-defined]  # run by each pool worker at start-up


def answer_op(op: str, a: str, b: str) -> str | bool | None:
    """Majority voting's two math-verify operations, run in a BoundedPool (rewards/answers.py):
    ("extract", response, "") -> the final answer as written (None: none found), parsed exactly as
    math_equal parses a response; ("same", x, y) -> whether two extracted answers are equal."""
    import logging

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    if op == "same":
        return math_equal("", "\\boxed{" + a + "}", b)
    if op != "extract":
        raise ValueError(f"answer_op: unknown op {op!r}")
    pred = parse(a[-MAX_RESPONSE_CHARS:], [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
                 parsing_timeout=None)
    if not pred:
        return None
    return pred[1] if len(pred) > 1 and isinstance(pred[1], str) else str(pred[0])


answer_op.warmup = _warmup  # type: ignore[attr-defined]
ANSWER_SPEC = "vapo_megatron.rewards.math_reward:answer_op"
