"""Sampled evaluation over all DP ranks: K samples per held-out prompt, rewards, answers, votes.

Used by the trainer's periodic eval (eval/avg@K, eval/pass@k, eval/maj@K) and by vapo-eval.
Prompts are split over DP ranks in contiguous shares; each replica samples its share on its
engines (rollout_collect._generate_and_share) and its first rank scores it with the run's reward
function and extracts the answers for the vote; global rank 0 gathers every row and computes
the figures (eval_metrics.py). Sample j of prompt i is drawn with seed `seed + i * K + j`,
whatever the number of ranks or engines, so a run with one process and one under torchrun draw
the same samples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch.distributed as dist

from vapo_megatron import parallel
from vapo_megatron.data.prompts import PromptRecord
from vapo_megatron.eval_metrics import PromptSamples, Vote, majority_vote, summarize
from vapo_megatron.rewards import score_batch
from vapo_megatron.rollout.base import SamplingParams
from vapo_megatron.rollout_collect import RolloutContext, _generate_and_share


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


def sample_eval(ctx: RolloutContext, records: list[PromptRecord], *, n: int, temperature: float, seed: int
                ) -> SampledEval | None:
    """Collective over the world. Returns the result on global rank 0, None elsewhere."""
    per = -(-len(records) // parallel.dp_size())
    first = parallel.dp_rank() * per
    mine = records[first : first + per]
    rows: list[SampleRow] = []
    if mine:
        r = ctx.cfg.rollout
        params = SamplingParams(n=n, temperature=temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                                stop_token_ids=ctx.stop_token_ids, seed=seed + first * n)
        outputs = _generate_and_share(ctx, mine, params)
        if dist.get_rank(parallel.model_parallel_group()) == 0:  # one scorer per replica
            rows = _score(ctx, mine, first, outputs, n)
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    parallel.gather_object(rows, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    rows = sorted((row for part in gathered for row in part), key=lambda x: (x.prompt_index, x.sample_index))
    by_prompt = [rows[i * n : (i + 1) * n] for i in range(len(records))]
    same = ctx.answers.equivalence([[x.answer for x in group] for group in by_prompt])
    votes = [majority_vote([x.answer for x in g], [x.correct for x in g], same) for g in by_prompt]
    samples = [PromptSamples(correct=[x.correct for x in g], answers=[x.answer for x in g],
                             lengths=[x.length for x in g], truncated=[x.truncated for x in g]) for g in by_prompt]
    return SampledEval(rows=rows, votes=votes, summary=summarize(samples, votes))


def _score(ctx: RolloutContext, prompts: list[PromptRecord], first: int, outputs, n: int) -> list[SampleRow]:
    texts = [ctx.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outputs]
    owners = [prompts[o.prompt_index] for o in outputs]
    scores, correct, _ = score_batch(ctx.reward_fn, [p.prompt_text for p in owners], texts, [p.answer for p in owners])
    extracted = ctx.answers.extract(texts)
    return [
        SampleRow(prompt_index=first + o.prompt_index, sample_index=k % n, source=p.source, correct=bool(ok),
                  reward=float(s), answer=a, ground_truth=p.answer, length=len(o.token_ids),
                  truncated=o.finish_reason == "length", response=t)
        for k, (o, p, t, s, ok, a) in enumerate(zip(outputs, owners, texts, scores, correct, extracted))
    ]


def row_dict(row: SampleRow) -> dict:
    return asdict(row)
