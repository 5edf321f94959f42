"""Steps 1-2 of the loop: a step's prompts and rollouts, with DAPO's dynamic sampling optional.

    rollouts = StepRollouts(generator, scorer, cfg.rollout, mini_batches=cfg.algo.mini_batches)
    rollout, logs = rollouts.collect(sampler, seed)       this DP rank's Rollout; rollout/* figures

Without dynamic sampling a step is one round: rollout.prompts_per_step prompts from the sampler,
n samples each. With it (DAPO sec. 3.2), a group whose samples the verifier scored all alike (all
right or all wrong; the verifier's score, before overlong shaping) carries no advantage under
GRPO and little under PPO, and is dropped; further rounds of prompts_per_step prompts are
generated until prompts_per_step groups are informative or rollout.max_sampling_rounds rounds
have run. Then the step trains on the groups it kept, the first of each round in the global
prompt order. reward/errors and reward/timeouts count the failed reward calls of every round,
rollout/samples_generated the responses generated (and judged). Too few to give every DP rank
algo.mini_batches groups (a mini-batch needs one),
and the last round's dropped groups top it up to that, logged as rollout/groups_topped_up.

Exactness: which groups are kept is decided globally (one all-reduce of a flag per prompt over
DP), the kept groups are dealt to DP ranks in equal contiguous shares of the global order (one
object all-gather over DP, only with dynamic sampling), and round r's sampling seed is a pure
function of (the step's seed, r): a resumed run draws, keeps and trains on the same groups. The
sampler's position advances by every prompt consumed, and is checkpointed with the run.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vapo_megatron.algorithms.advantages import informative_groups
from vapo_megatron.config import RolloutConfig
from vapo_megatron.data.prompts import PromptSampler
from vapo_megatron.mcore import parallel
from vapo_megatron.rollout.generator import Generator, Rollout
from vapo_megatron.rollout.partial import PartialRollouts

_ROUND_SEED_STRIDE = 104_729  # a prime: round r samples with seed + r * stride (round 0: the step's seed)


def fill(flags_per_round: list[list[bool]], target: int, floor: int) -> tuple[list[tuple[int, int]], int]:
    """The fill rule on global flags: the (round, prompt) of every group the step trains on, and
    how many of them top it up. Informative groups in round order, then prompt order, the first
    `target`; fewer than `floor`, and the last round's uninformative groups in prompt order are
    added until there are `floor` (or the round has no more)."""
    kept = [(r, i) for r, flags in enumerate(flags_per_round) for i, f in enumerate(flags) if f][:target]
    topped = 0
    if len(kept) < floor and flags_per_round:
        last = len(flags_per_round) - 1
        extra = [(last, i) for i, f in enumerate(flags_per_round[last]) if not f][: floor - len(kept)]
        kept, topped = sorted(kept + extra), len(extra)
    return kept, topped


def deal(items: list, parts: int, index: int) -> list:
    """Share `index` of `parts` equal contiguous shares (sizes differ by at most one)."""
    return items[index * len(items) // parts : (index + 1) * len(items) // parts]


class StepRollouts:
    def __init__(self, generator: Generator, scorer, rollout: RolloutConfig, *, mini_batches: int):
        self.generator, self.scorer, self.cfg, self.mini_batches = generator, scorer, rollout, mini_batches
        self.partial = PartialRollouts(generator, scorer, rollout, mini_batches=mini_batches)

    def collect(self, sampler: PromptSampler, seed: int, *, carry=None,
                version: int = 0) -> tuple[Rollout, dict[str, float]]:
        """This DP rank's rollout of the step, and rollout/* figures (global). `carry`: the run's
        carry-over buffer (RunState.carry), for rollout.partial (partial.py), which also drains a
        resumed buffer when partial rollout is off; `version`: the weights the engine serves."""
        if carry is not None and (self.cfg.partial.enabled or carry.drain):
            return self.partial.collect(sampler, carry, seed=seed, version=version)
        if not self.cfg.dynamic_sampling:
            return self.generator.collect(sampler.next_batch(), seed=seed), {}
        return self._dynamic(sampler, seed)

    def _dynamic(self, sampler: PromptSampler, seed: int) -> tuple[Rollout, dict[str, float]]:
        target = self.cfg.prompts_per_step
        rounds: list[Rollout] = []        # this rank's rollout of each round
        firsts: list[int] = []            # the global index of this rank's first prompt, per round
        flags_per_round: list[list[bool]] = []
        informative, errors, timeouts = 0, 0.0, 0.0  # the last two over every reward call of every round
        while len(rounds) < self.cfg.max_sampling_rounds and informative < target:
            prompts = sampler.next_batch()                                        # global, every rank alike
            rollout = self.generator.collect(prompts, seed=(seed + len(rounds) * _ROUND_SEED_STRIDE) % (2**31 - 1))
            results = self.scorer.results(rollout)
            rollout = replace(rollout, results=results)
            local = informative_groups([r.score for r in results], [o.prompt_index for o in rollout.outputs],
                                       len(rollout.prompts))
            first, _ = parallel.dp_share(prompts)
            # A flag per prompt, then this rank's failed reward calls: one all-reduce for both.
            flags = torch.zeros(len(prompts) + 2, dtype=torch.float64)
            flags[first : first + len(local)] = torch.tensor(local, dtype=torch.float64)
            flags[-2:] = torch.tensor([sum(r.error is not None for r in results), sum(r.timed_out for r in results)],
                                      dtype=torch.float64)
            if parallel.dp_size() > 1:
                parallel.all_reduce(flags, group=parallel.dp_group())
            flags_per_round.append([bool(f) for f in flags[:-2].tolist()])
            errors, timeouts = errors + float(flags[-2]), timeouts + float(flags[-1])
            rounds.append(rollout)
            firsts.append(first)
            informative += sum(flags_per_round[-1])
        kept, topped = fill(flags_per_round, target, floor=parallel.dp_size() * self.mini_batches)
        mine = deal(self._gather(rounds, firsts, set(kept)), parallel.dp_size(), parallel.dp_rank())
        logs = {  # groups: kept + surplus (informative, past the target) + dropped (uninformative) = generated
            "rollout/sampling_rounds": float(len(rounds)),
            "rollout/prompts_consumed": float(len(rounds) * target),
            "rollout/groups_kept": float(len(kept) - topped),
            "rollout/groups_surplus": float(informative - (len(kept) - topped)),
            "rollout/groups_dropped": float(len(rounds) * target - informative),
            "rollout/groups_topped_up": float(topped),
            "rollout/samples_generated": float(len(rounds) * target * self.cfg.n_samples),  # each judged once
            # Every round's reward calls, the dropped groups' too (the scorer counts none of them again).
            "reward/errors": errors,
            "reward/timeouts": timeouts,
        }
        if informative < target and parallel.is_rank0():
            print(f"[vapo] dynamic sampling: {informative} informative groups of {target} after "
                  f"rollout.max_sampling_rounds={self.cfg.max_sampling_rounds} rounds; training on {len(kept)} groups"
                  + (f" ({topped} uninformative ones added so that every DP rank has a mini-batch)" if topped else ""),
                  flush=True)
        return self._assemble(mine), logs

    def _gather(self, rounds: list[Rollout], firsts: list[int], kept: set) -> list[tuple]:
        """Every DP rank's kept groups, in global (round, prompt) order: (key, prompt, outputs, results)."""
        local = []
        for r, (rollout, first) in enumerate(zip(rounds, firsts)):
            for i, prompt in enumerate(rollout.prompts):
                if (r, first + i) in kept:
                    rows = [k for k, o in enumerate(rollout.outputs) if o.prompt_index == i]
                    local.append(((r, first + i), prompt, [rollout.outputs[k] for k in rows],
                                  [rollout.results[k] for k in rows]))
        if parallel.dp_size() == 1:
            return local
        everyone: list = [None] * parallel.dp_size()
        parallel.all_gather_object(everyone, local, group=parallel.wait_group("data_parallel"))
        return sorted((g for part in everyone for g in part), key=lambda g: g[0])

    def _assemble(self, groups: list[tuple]) -> Rollout:
        prompts, outputs, results = [], [], []
        for j, (_, prompt, outs, res) in enumerate(groups):
            prompts.append(prompt)
            outputs += [replace(o, prompt_index=j) for o in outs]
            results += res
        return Rollout(prompts=prompts, outputs=outputs, n=self.cfg.n_samples, results=results)


__all__ = ["StepRollouts", "deal", "fill"]
