"""The positive control's oracle value function (issue 54; docs/benchmarks.md, "Can any critic help?").

    torchrun --nproc-per-node 2 scripts/bench_oracle.py --config FILE [dotted overrides]

(that script launches this module's main) is vapo-train with the learned critic replaced by an
oracle of the chain task (what the learning benchmark runs for the `vapo_oracle` arm: the script's
path is that row's "entry", recorded in each of its runs). It is a control, not a product feature:
nothing of it is in the trainer. This file swaps the one name the loop builds its critic role
with (trainer.py's `build_critic`), then runs vapo-train's own main(); everything else (GAE, the
losses, checkpoints, evals) is the trainer's.

The oracle's V(s_t), at the position that predicts response token t (data/batch.py), is a function
of the prompt and the prefix o_<t only:
  - o_<t has left the worked chain (a token differs from the chain's, or the answer did not stop
    where the chain ends): under the exact reward no continuation can be right, so
    V = reward.incorrect_score, exactly;
  - otherwise o_<t is the chain's own first t tokens, and so is the prefix of every other sample
    of the group still on the chain at t. Each of those continued from that same prefix by the
    rollout policy, independently of this response, so the mean reward of the OTHER samples of
    the group still on the chain at t is an unbiased Monte-Carlo estimate of V^pi_old(o_<t) that
    uses none of this response's own tokens after t (leave-one-out: VinePPO's estimate, arXiv
    2410.01679, with the group's siblings as its rollouts and no extra generation);
  - no other sample of the group is still on the chain at t: the estimate of the longest shorter
    prefix that had one is carried forward (at t = 0 every sibling qualifies; a group of one gets
    the midpoint of the two scores). This is the oracle's bias: a longer correct prefix is usually
    worth more than a shorter one, so a carried estimate tends to be low. Its share of the
    response tokens is logged as critic/oracle_carried_fraction.
Noise: an estimate from m siblings has the binomial variance of m draws (m <= n_samples - 1 = 7).
Cost: no model, no generation; a token comparison per response per step.
"""

from __future__ import annotations

import math
import re

import torch

CHAIN_PROMPT = re.compile(r"((?:[a-k]\d\+)+[a-k]\d)=")  # the user turn "a3+b5+c8=" inside the chat template


def first_wrong(response: list[int], chain: list[int], correct: bool) -> float:
    """The index of the response's first token off the worked chain `chain` (the answer's tokens,
    without the stop token); inf for a response the reward scored correct. A response that matched
    the whole chain but was scored wrong did not stop where the chain ends: its token there is the
    first wrong one. One that matched and ended before the chain's end without a stop is never off it."""
    if correct:
        return math.inf
    for t, (a, b) in enumerate(zip(response, chain)):
        if a != b:
            return t
    return min(len(response), len(chain))


def oracle_values(responses: list[list[int]], chains: list[list[int]], correct: list[bool], rewards: list[float],
                  groups: list[int], wrong_value: float, right_value: float) -> tuple[list[list[float]], int]:
    """(V[i][t] for t < len(responses[i]), how many of them were carried forward), as the module
    docstring defines them. Samples of one group share a group id and their prompt's chain."""
    fw = [first_wrong(r, c, ok) for r, c, ok in zip(responses, chains, correct)]
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out, carried = [], 0
    for i, resp in enumerate(responses):
        siblings = [j for j in members[groups[i]] if j != i]
        v, last = [], (wrong_value + right_value) / 2
        for t in range(len(resp)):
            if t > fw[i]:  # o_<t holds the wrong token at fw[i] <= t - 1
                v.append(wrong_value)
                continue
            still = [rewards[j] for j in siblings if fw[j] >= t]  # on the chain through o_<t
            if still:
                last = sum(still) / len(still)
            else:
                carried += 1
            v.append(last)
        out.append(v)
    return out, carried


class OracleCritic:
    """The critic role (mcore/critic.py's Critic and NoCritic have the same calls) with oracle values:
    no model, nothing checkpointed, offloaded or updated."""

    models: dict = {}
    absent_phases = ("critic_update",)  # trainer/timing.py: no critic update happens

    def __init__(self, cfg):
        from transformers import AutoTokenizer

        from vapo_megatron.tasks.chain_task import chain_answer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        self.chain_answer = chain_answer
        self.wrong, self.right = cfg.reward.incorrect_score, cfg.reward.correct_score
        self.carried = self.tokens = 0.0

    def chain_tokens(self, prompt_ids: list[int]) -> list[int]:
        text = self.tokenizer.decode(prompt_ids)
        found = CHAIN_PROMPT.search(text)
        if found is None:
            raise ValueError(f"bench_oracle: no chain-task prompt in {text!r}; the oracle knows only the chain task")
        terms = [int(term[1]) for term in found.group(1).split("+")]
        return self.tokenizer.encode(self.chain_answer(terms), add_special_tokens=False)

    def start_from(self, actor) -> None:
        pass

    def values(self, batch) -> torch.Tensor:
        """Step 4: V_t at every prediction position, [B, S] (zero elsewhere)."""
        from vapo_megatron.data.batch import to_sequence

        P, R = batch.prompt_lens.tolist(), batch.response_lens.tolist()
        rows = batch.tokens.tolist()
        chains = [self.chain_tokens(row[:p]) for row, p in zip(rows, P)]
        responses = [row[p:p + r] for row, p, r in zip(rows, P, R)]
        v, carried = oracle_values(responses, chains, batch.correct.tolist(), batch.rewards.float().tolist(),
                                   batch.group_ids.tolist(), self.wrong, self.right)
        self.carried, self.tokens = float(carried), float(sum(R))
        T = max(max(R), 1)
        resp = torch.tensor([x + [0.0] * (T - len(x)) for x in v], dtype=torch.float32)  # [B, T]
        return to_sequence(resp, batch.prompt_lens, batch.response_lens, batch.tokens.shape[1])

    def fit(self, batch) -> dict[str, float]:
        """How well the oracle's values predict the step's returns, as the learned critic's are logged."""
        from vapo_megatron.algorithms import step_stats
        from vapo_megatron.mcore import dp_stats

        tokens = dp_stats.global_sum(self.tokens)
        return {"critic/explained_variance": step_stats.explained_variance(batch.values, batch.returns, batch.mask,
                                                                               reduce=dp_stats.dp_sum),
                "critic/oracle_carried_fraction": dp_stats.global_sum(self.carried) / max(tokens, 1.0)}

    def update(self, batch, *, value_pretrain: bool) -> dict[str, float]:
        return {}


def main(argv: list[str] | None = None) -> int:
    from vapo_megatron import train
    from vapo_megatron.trainer import trainer as loop

    loop.build_critic = lambda cfg, update, **_: OracleCritic(cfg)  # the one swap (see the module docstring)
    print("[bench_oracle] the critic is the chain task's oracle (scripts/bench_oracle.py), not a learned model",
          flush=True)
    return train.main(argv)
