"""Sampled-evaluation metrics as the paper reports them (avg@K, pass@k, maj@K); pure functions.

Inputs are per prompt: n samples, c of them correct, and the answers extracted from the samples.
  avg@K   mean accuracy over all samples (the paper's AIME 2024 figure is avg@32: 32 samples per
          problem at the training temperature, sec. 4.1)
  pass@k  unbiased estimate of "at least one of k samples is correct" from n >= k samples:
          1 - C(n - c, k) / C(n, k) per prompt, averaged over prompts (Chen et al. 2021, "Evaluating
          Large Language Models Trained on Code", the Codex paper)
  maj@K   the answer given most often among the K samples is correct (majority vote)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the probability that k samples drawn without replacement from n,
    c of them correct, include a correct one. Computed as 1 - prod_{i=n-c+1..n} (1 - k/i), which
    never forms a binomial coefficient (C(32, 16) is fine, C(1024, 512) overflows a float)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def k_ladder(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


@dataclass(frozen=True)
class Vote:
    answer: str | None  # the winning answer (None: no sample had an answer)
    votes: int          # samples whose answer is equivalent to it
    index: int | None   # the sample that represents it (its first occurrence)
    correct: bool       # that sample's verdict


def majority_vote(answers: Sequence[str | None], correct: Sequence[bool],
                  same: Callable[[str, str], bool] = str.__eq__) -> Vote:
    """Majority vote over one prompt's samples.

    answers[j]: the answer extracted from sample j (None or "": no answer; it does not vote).
    same(a, b): answer equivalence (math-verify for math rewards; string equality otherwise).
    Samples are grouped in order: each answer joins the first earlier group whose representative
    (that group's first answer) it is equivalent to. The largest group wins.
    Tie rule: among groups of equal size, the one whose first sample comes first wins (sample
    order, not correctness, breaks ties, so a tie is never resolved in the model's favour).
    The vote is correct when the winning group's representative sample was judged correct.
    """
    if len(answers) != len(correct):
        raise ValueError(f"majority_vote: {len(answers)} answers but {len(correct)} verdicts")
    groups: list[list[int]] = []  # sample indices; groups[g][0] is the representative
    for j, a in enumerate(answers):
        if not a:
            continue
        for g in groups:
            if same(a, answers[g[0]]):
                g.append(j)
                break
        else:
            groups.append([j])
    if not groups:
        return Vote(answer=None, votes=0, index=None, correct=False)
    best = max(groups, key=len)  # max keeps the first of equal keys: the tie rule
    return Vote(answer=answers[best[0]], votes=len(best), index=best[0], correct=bool(correct[best[0]]))


@dataclass(frozen=True)
class PromptSamples:
    """One prompt's K samples, in sample order."""

    correct: list[bool]
    answers: list[str | None]
    lengths: list[int]        # response tokens
    truncated: list[bool]     # stopped by max_new_tokens


def summarize(prompts: Sequence[PromptSamples], votes: Sequence[Vote]) -> dict[str, float]:
    """The figures of one evaluation: avg@K, pass@k for k in k_ladder(K), maj@K, lengths.
    Every prompt must have the same K samples (pass@k and avg@K then agree at k = 1)."""
    if not prompts:
        raise ValueError("no prompts to evaluate")
    n = len(prompts[0].correct)
    if any(len(p.correct) != n for p in prompts):
        raise ValueError("every prompt needs the same number of samples")
    lengths = [x for p in prompts for x in p.lengths]
    out = {f"avg@{n}": sum(sum(p.correct) for p in prompts) / (n * len(prompts))}
    for k in k_ladder(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(p.correct), k) for p in prompts) / len(prompts)
    out[f"maj@{n}"] = sum(v.correct for v in votes) / len(prompts)
    out["response_length/mean"] = sum(lengths) / len(lengths)
    out["response_length/max"] = float(max(lengths))
    out["response_length/clip_ratio"] = sum(sum(p.truncated) for p in prompts) / len(lengths)
    return out
