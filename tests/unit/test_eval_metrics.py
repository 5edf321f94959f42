"""avg@K / pass@k / maj@K (vapo_megatron/eval_metrics.py) against independent references:
pass@k by enumerating every k-subset of the samples, maj@K on hand-made answer sets."""

from __future__ import annotations

import itertools
import math

import pytest

from vapo_megatron.evaluation.metrics import PromptSamples, k_ladder, majority_vote, pass_at_k, summarize


def brute_force_pass_at_k(correct: list[bool], k: int) -> float:
    """The fraction of the k-subsets of the samples that hold a correct one."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10])
def test_pass_at_k_equals_enumeration_over_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            # where the correct samples sit does not matter; two placements make sure
            for correct in ([True] * c + [False] * (n - c), [False] * (n - c) + [True] * c):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(correct, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_where_binomials_overflow():
    # C(2000, 1000) is ~1e600, beyond a float; the product form needs no binomial.
    n, c, k = 2000, 3, 1000
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # Python's integers and true division: exact
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert pass_at_k(n, 0, k) == 0.0 and pass_at_k(n, n - k + 1, k) == 1.0
    assert pass_at_k(32, 5, 1) == pytest.approx(5 / 32)  # pass@1 is the accuracy


def test_pass_at_k_refuses_k_beyond_the_samples():
    with pytest.raises(ValueError, match="pass@9 needs at least 9 samples per prompt, got 8"):
        pass_at_k(8, 3, 9)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)


def test_k_ladder():
    assert k_ladder(1) == [1]
    assert k_ladder(32) == [1, 2, 4, 8, 16, 32]
    assert k_ladder(12) == [1, 2, 4, 8, 12]


def test_majority_vote_plain():
    v = majority_vote(["3", "5", "3", "7", "3"], [True, False, True, False, True])
    assert (v.answer, v.votes, v.index, v.correct) == ("3", 3, 0, True)
    v = majority_vote(["5", "3", "5"], [False, True, False])
    assert (v.answer, v.votes, v.correct) == ("5", 2, False)  # the majority is wrong: maj is wrong


def test_majority_vote_tie_goes_to_the_answer_seen_first():
    # 2 votes each for "4" (wrong) and "6" (right): "4" appears first and wins.
    v = majority_vote(["4", "6", "6", "4", "9"], [False, True, True, False, False])
    assert (v.answer, v.votes, v.index, v.correct) == ("4", 2, 0, False)
    # the same votes in another order: now "6" comes first
    v = majority_vote(["9", "6", "4", "4", "6"], [False, True, False, False, True])
    assert (v.answer, v.votes, v.index, v.correct) == ("6", 2, 1, True)
    # a three-way tie of single votes: the first sample's answer
    assert majority_vote(["a", "b", "c"], [False, True, True]).answer == "a"


def test_majority_vote_skips_missing_answers_and_uses_equivalence():
    # None / "" do not vote, even when they are the most common "answer".
    v = majority_vote([None, "", None, "2", None], [False, False, False, True, False])
    assert (v.answer, v.votes, v.index, v.correct) == ("2", 1, 3, True)
    assert majority_vote([None, ""], [False, False]).correct is False
    # math-style equivalence: 1/2 and 0.5 vote together and outnumber "3"
    same = lambda a, b: {a, b} <= {"1/2", "0.5", r"\frac{1}{2}"} or a == b  # noqa: E731
    v = majority_vote(["3", "0.5", "3", "1/2", r"\frac{1}{2}"], [False, True, False, True, True], same)
    assert (v.answer, v.votes, v.index, v.correct) == ("0.5", 3, 1, True)


def test_summarize_agrees_with_its_parts():
    prompts = [
        PromptSamples(correct=[True, False, False, True], answers=["1", "2", "2", "1"], lengths=[3, 5, 8, 2],
                      truncated=[False, False, True, False]),
        PromptSamples(correct=[False, False, False, False], answers=["x", "y", None, "y"], lengths=[4, 4, 4, 4],
                      truncated=[False] * 4),
    ]
    votes = [majority_vote(p.answers, p.correct) for p in prompts]
    s = summarize(prompts, votes)
    assert s["avg@4"] == pytest.approx(2 / 8) == pytest.approx(s["pass@1"])
    assert s["pass@2"] == pytest.approx((brute_force_pass_at_k(prompts[0].correct, 2) + 0) / 2)
    assert s["pass@4"] == pytest.approx(0.5)
    assert s["maj@4"] == pytest.approx(0.5)  # prompt 0: "1" and "2" tie, "1" came first and is right
    assert ((s["response_length/mean"], s["response_length/max"], s["response_length/clip_ratio"])
            == (34 / 8, 8.0, 1 / 8))
