"""Steps 1-2 with partial rollout (rollout.partial; docs/training.md, "Partial rollout").

    partial = PartialRollouts(generator, scorer, cfg.rollout, mini_batches=cfg.algo.mini_batches)
    rollout, logs = partial.collect(sampler, carry, seed=..., version=...)

A step of DP rank d, at weight version v (the actor updates done, RunState.policy_version: the
policy the engine serves; a value-pretraining step leaves it, so its tokens do not age):
1. Restart: a sample whose first token is more than max_staleness versions old is generated
   afresh from its prompt (in its group, with a new seed). The wait in 4 keeps this from
   happening; it is the rule for a buffer saved under a larger bound (a resume that lowered it).
   Its prompt is not handed back to the sampler: the sampler's order stays a pure function of its
   seed, so no prompt is skipped or repeated, and its group stays whole.
2. Admit: prompt batches (of prompts_per_step, dealt over DP as without partial rollout) until
   (1 + spare_batches) x prompts_per_step groups are in flight over all DP ranks (one all-reduce).
3. Rounds: every unfinished sample grows by at most round_tokens tokens (engine.extend, which
   continues it exactly where it stopped, with the current weights). A step runs at least one
   round while anything is unfinished: the spare groups advance even when finished groups left
   over from the last step already fill this one.
4. Stop after a round when no group is due (a group whose first token is max_staleness versions
   old: next step it would be older, so the step waits for it), and either this rank's share of
   prompts_per_step groups has finished, or the decode-step budget is spent and every mini-batch
   has a finished group, or nothing is left to generate.
5. Train on the due groups and then the oldest finished ones, up to the share; the rest stays in
   the buffer. With dynamic sampling, a finished group the verifier scored all alike is dropped
   (and tops the step up to one group per mini-batch when it has fewer).
Every decision is local to the DP rank (its buffer never moves), from the outputs every rank of
its replica holds alike, and every seed is stored with its sample: a resumed run makes the same
decisions. A run whose checkpoint holds groups but has partial rollout off drains them: its next
step runs them, with its new batch, to the end (drain=True) and trains on all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vapo_megatron.algorithms.advantages import informative_groups
from vapo_megatron.config import RolloutConfig
from vapo_megatron.data.carry_over import CarryOver, Group, Sample
from vapo_megatron.data.prompts import PromptSampler
from vapo_megatron.mcore import parallel
from vapo_megatron.rollout.base import Continuation, RolloutOutput
from vapo_megatron.rollout.generator import Rollout

BATCH_SEED_STRIDE = 104_729      # batch b of a step samples with seed + b * stride (dynamic_sampling's rounds)
RESTART_SEED_STRIDE = 7_919_981  # a restarted sample's seed: seed + stride + key * n + j


@dataclass(frozen=True)
class DataParallel:
    """The DP rank's view the collector needs: its size and rank, a sum over DP ranks, and the
    contiguous share of a prompt batch (parallel.dp_share's rule)."""

    size: int
    rank: int

    @classmethod
    def current(cls) -> "DataParallel":
        return cls(parallel.dp_size(), parallel.dp_rank())

    def sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.size > 1:
            parallel.all_reduce(t, group=parallel.dp_group())
        return t.tolist()

    def share(self, items: list) -> tuple[int, list]:
        per = -(-len(items) // self.size)
        return self.rank * per, items[self.rank * per : (self.rank + 1) * per]


class PartialRollouts:
    def __init__(self, generator, scorer, rollout: RolloutConfig, *, mini_batches: int, dp: DataParallel | None = None):
        self.generator, self.scorer, self.cfg, self.mini_batches, self.dp = generator, scorer, rollout, mini_batches, dp

    def collect(self, sampler: PromptSampler, carry: CarryOver, *, seed: int, version: int) -> tuple[Rollout, dict]:
        r, p = self.cfg, self.cfg.partial
        dp = self.dp or DataParallel.current()
        drain = not p.enabled
        restarted = self._restart(carry, version, seed)
        admitted = self._admit(sampler, carry, seed, dp, batches=1 if drain else None)
        target = len(dp.share(list(range(r.prompts_per_step)))[1])
        rounds = steps = new_tokens = 0
        params = self.generator.sampling(seed=seed, n=1)
        while True:
            ready, dropped = self._judge(carry, sampler)
            active = [(g, s) for g in carry.groups for s in g.samples if s.finish is None]
            if not active or (rounds and not drain and self._enough(carry, ready, version, target, steps)):
                break
            length = r.max_new_tokens if drain else p.round_tokens
            if p.max_decode_steps is not None and steps < p.max_decode_steps:
                length = min(length, p.max_decode_steps - steps)
            requests = [Continuation(sampler.records[g.index].prompt_ids, s.tokens, s.seed,
                                     min(length, r.max_new_tokens - len(s.tokens))) for g, s in active]
            outs = self.generator.extend(requests, params)
            for (g, s), o in zip(active, outs):
                if o.logprobs is None:
                    raise RuntimeError("partial rollout needs the engine's log-prob of every sampled token")
                s.tokens, s.logprobs = s.tokens + o.token_ids, s.logprobs + o.logprobs
                s.versions = s.versions + [version] * len(o.token_ids)  # the weights the step's sync loaded
                if o.finish_reason == "stop" or len(s.tokens) >= r.max_new_tokens:
                    s.finish = "stop" if o.finish_reason == "stop" else "length"
            rounds, steps = rounds + 1, steps + max(len(o.token_ids) for o in outs)
            new_tokens += sum(len(o.token_ids) for o in outs)
        self.generator.end_rounds()
        due = [g for g in ready if self._due(g, version)]
        chosen = ready if drain else due + [g for g in ready if g not in due][: max(target - len(due), 0)]
        topped = dropped[: max(self.mini_batches - len(chosen), 0)]
        chosen = sorted(chosen + topped, key=lambda g: g.key)
        gone = {id(g) for g in chosen + dropped}
        carry.groups = [g for g in carry.groups if id(g) not in gone]
        carry.drain = False
        unfinished = sum(s.finish is None for g in carry.groups for s in g.samples)
        totals = dp.sum([admitted, len(chosen), len(carry.groups), unfinished, restarted, rounds, steps, new_tokens,
                         len(due), len(dropped), len(topped)])
        names = ["groups_admitted", "groups_trained", "groups_carried", "samples_carried", "samples_restarted",
                 "rounds", "decode_steps", "new_tokens", "groups_waited"]
        logs = {f"partial/{k}": v / (dp.size if k in ("rounds", "decode_steps") else 1) for k, v in zip(names, totals)}
        # As the synchronous dynamic sampling counts them: prompts taken from the sampler this step, and
        # responses begun (theirs and the restarted ones); a carried response counts once, when begun.
        logs |= {"rollout/prompts_consumed": totals[0],
                 "rollout/samples_generated": totals[0] * r.n_samples + totals[4]}
        if r.dynamic_sampling:
            logs |= {"rollout/groups_dropped": totals[9], "rollout/groups_topped_up": totals[10]}
        return self._assemble(chosen, sampler, version), logs

    # ---- the parts of a step ---------------------------------------------------------------------

    def _restart(self, carry: CarryOver, version: int, seed: int) -> int:
        n, count = self.cfg.n_samples, 0
        for g in carry.groups:
            for j, s in enumerate(g.samples):
                if s.oldest is not None and s.oldest < version - self.cfg.partial.max_staleness:
                    g.samples[j] = Sample((seed + RESTART_SEED_STRIDE + g.key * n + j) % (2**31 - 1))
                    g.results, count = None, count + 1
        return count

    def _admit(self, sampler: PromptSampler, carry: CarryOver, seed: int, dp: DataParallel, *,
               batches: int | None) -> int:
        """Admits whole sampler batches (every rank alike); returns how many groups this rank got."""
        P, n = self.cfg.prompts_per_step, self.cfg.n_samples
        if batches is None:  # top up to (1 + spare) x P groups in flight over all DP ranks
            in_flight = int(dp.sum([len(carry.groups)])[0])
            batches = max(0, -(-((1 + self.cfg.partial.spare_batches) * P - in_flight) // P))
        mine = 0
        for b in range(batches):
            base = (seed + b * BATCH_SEED_STRIDE) % (2**31 - 1)
            first, share = dp.share(sampler.next_indices())
            for i, index in enumerate(share):  # sample j of prompt first + i: the sync step's seed
                carry.groups.append(Group(carry.admitted + first + i, index,
                                          [Sample(base + (first + i) * n + j) for j in range(n)]))
            carry.admitted += P
            mine += len(share)
        return mine

    def _judge(self, carry: CarryOver, sampler: PromptSampler) -> tuple[list[Group], list[Group]]:
        """(finished groups that may train, finished groups dynamic sampling drops), by key."""
        complete = [g for g in carry.groups if g.complete]
        if not self.cfg.dynamic_sampling:
            return complete, []
        new = [g for g in complete if g.results is None]
        if new:
            judged = self.scorer.results(self._assemble(new, sampler, version=0, judged=False))
            for k, g in enumerate(new):
                g.results = judged[k * self.cfg.n_samples : (k + 1) * self.cfg.n_samples]
        flags = informative_groups([x.score for g in complete for x in g.results],
                                   [k for k, g in enumerate(complete) for _ in g.samples], len(complete))
        return [g for g, f in zip(complete, flags) if f], [g for g, f in zip(complete, flags) if not f]

    def _due(self, g: Group, version: int) -> bool:
        return g.oldest is not None and g.oldest <= version - self.cfg.partial.max_staleness

    def _enough(self, carry: CarryOver, ready: list[Group], version: int, target: int, steps: int) -> bool:
        if any(self._due(g, version) and not g.complete for g in carry.groups):
            return False
        budget = self.cfg.partial.max_decode_steps
        return len(ready) >= target or (budget is not None and steps >= budget and len(ready) >= self.mini_batches)

    def _assemble(self, groups: list[Group], sampler: PromptSampler, version: int, *, judged: bool = True) -> Rollout:
        outputs = [RolloutOutput(prompt_index=k, token_ids=s.tokens, finish_reason=s.finish or "length",
                                 logprobs=s.logprobs, weight_version=s.oldest if s.oldest is not None else version,
                                 token_versions=s.versions) for k, g in enumerate(groups) for s in g.samples]
        results = [x for g in groups for x in g.results] if judged and self.cfg.dynamic_sampling and groups else None
        return Rollout(prompts=[sampler.records[g.index] for g in groups], outputs=outputs, n=self.cfg.n_samples,
                       results=results)


__all__ = ["DataParallel", "PartialRollouts"]
