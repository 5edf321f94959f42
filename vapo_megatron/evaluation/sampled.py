"""Evaluation over all DP ranks: greedy accuracy, and K samples per held-out prompt with their
rewards, answers and votes.

    greedy_accuracy(gen, scorer, records)                       eval/accuracy (and the warm start's)
    sample_eval(gen, scorer, answers, records, n=K, ...)        eval/avg@K, eval/pass@k, eval/maj@K

Used by the trainer's periodic eval and by vapo-eval. Prompts are split over DP ranks in
contiguous shares; each replica samples its share on its engines (rollout/generator.py) and its
first rank scores it with the run's reward function and extracts the answers for the vote;
global rank 0 gathers every row and computes the figures (metrics.py). Sample j of prompt i is
drawn with seed `seed + i * K + j`, whatever the number of ranks or engines, so a run with one
process and one under torchrun draw the same samples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from vapo_megatron.data.prompts import PromptRecord
from vapo_megatron.evaluation.metrics import PromptSamples, Vote, majority_vote, summarize
from vapo_megatron.mcore import parallel
from vapo_megatron.rewards.answers import AnswerKey
from vapo_megatron.rewards.scorer import Scorer
from vapo_megatron.rollout.generator import Generator


@dataclass
class SampleRow:
    """One sample, as samples.jsonl holds it."""

    prompt_index: int   # into the evaluated prompts (the first eval.max_prompts of the files)
    sample_index: int
    source: str         # file:line of the prompt
    correct: bool
    reward: float
    answer: str | None  # extracted for the vote (None: none found)
    ground_truth: str
    length: int         # response tokens
    truncated: bool     # stopped by max_new_tokens
    response: str


@dataclass
class SampledEval:
    rows: list[SampleRow]         # prompt-major, sample order within a prompt
    votes: list[Vote]             # one per prompt
    summary: dict[str, float]     # avg@K, pass@k, maj@K, response_length/*


def greedy_accuracy(gen: Generator, scorer: Scorer, records: list[PromptRecord]) -> float:
    """Collective. Greedy accuracy over all DP ranks (eval/accuracy on the held-out set)."""
    _, mine = parallel.dp_share(records)
    correct = 0.0
    if mine:
        outputs = gen.generate(mine, gen.sampling(seed=0, greedy=True))
        _, ok, _ = scorer.judge([r.prompt_text for r in mine], scorer.decode(outputs), [r.answer for r in mine])
        correct = float(ok.sum())
    t = torch.tensor([correct], dtype=torch.float64)
    if parallel.dp_size() > 1:  # replicas with no share (or a short one) wait for the others' generation: on the CPU
        parallel.all_reduce(t, group=parallel.wait_group("data_parallel"))
    return float(t) / max(len(records), 1)


def sample_eval(gen: Generator, scorer: Scorer, answers: AnswerKey, records: list[PromptRecord], *, n: int,
                temperature: float, seed: int) -> SampledEval | None:
    """Collective over the world. Returns the result on global rank 0, None elsewhere."""
    first, mine = parallel.dp_share(records)
    rows: list[SampleRow] = []
    if mine:
        outputs = gen.generate(mine, gen.sampling(seed=seed + first * n, n=n, temperature=temperature))
        if dist.get_rank(parallel.model_parallel_group()) == 0:  # one scorer per replica
            rows = _score(scorer, answers, mine, first, outputs, n)
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    # Every rank waits here for the slowest replica's generation: a CPU wait (parallel.wait_group).
    parallel.gather_object(rows, gathered, dst=0, group=parallel.wait_group())
    if dist.get_rank() != 0:
        return None
    rows = sorted((row for part in gathered for row in part), key=lambda x: (x.prompt_index, x.sample_index))
    by_prompt = [rows[i * n : (i + 1) * n] for i in range(len(records))]
    same = answers.equivalence([[x.answer for x in group] for group in by_prompt])
    votes = [majority_vote([x.answer for x in g], [x.correct for x in g], same) for g in by_prompt]
    samples = [PromptSamples(correct=[x.correct for x in g], answers=[x.answer for x in g],
                             lengths=[x.length for x in g], truncated=[x.truncated for x in g]) for g in by_prompt]
    return SampledEval(rows=rows, votes=votes, summary=summarize(samples, votes))


def _score(scorer: Scorer, answers: AnswerKey, prompts: list[PromptRecord], first: int, outputs,
           n: int) -> list[SampleRow]:
    texts = scorer.decode(outputs)
    owners = [prompts[o.prompt_index] for o in outputs]
    scores, correct, _ = scorer.judge([p.prompt_text for p in owners], texts, [p.answer for p in owners])
    extracted = answers.extract(texts)
    return [
        SampleRow(prompt_index=first + o.prompt_index, sample_index=k % n, source=p.source, correct=bool(ok),
                  reward=float(s), answer=a, ground_truth=p.answer, length=len(o.token_ids),
                  truncated=o.finish_reason == "length", response=t)
        for k, (o, p, t, s, ok, a) in enumerate(zip(outputs, owners, texts, scores, correct, extracted))
    ]


def row_dict(row: SampleRow) -> dict:
    return asdict(row)
