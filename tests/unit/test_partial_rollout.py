"""Partial rollout's step (rollout/partial.py) on the embedded engine in this process: groups train
only whole, the staleness bound holds, no prompt is skipped or repeated, carried responses are the
one-go responses of their seeds, the buffer's file restores it exactly, and with nothing to carry
the step is the synchronous one (issue 47)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from transformers import Qwen2Config

from vapo_megatron.config import PartialRolloutConfig, RolloutConfig
from vapo_megatron.data import carry_over
from vapo_megatron.data.carry_over import CarryOver
from vapo_megatron.data.prompts import PromptRecord, PromptSampler
from vapo_megatron.rollout.base import SamplingParams
from vapo_megatron.rollout.embedded import EmbeddedEngine
from vapo_megatron.rollout.generator import Generator, Rollout
from vapo_megatron.rollout.partial import DataParallel, PartialRollouts

STOPS = tuple(range(3, 23))  # 20 of 96 tokens end a response: lengths spread from 1 to max_new_tokens


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, eos_token_id=3)
    return EmbeddedEngine.from_hf_config(cfg)


def records(k: int) -> list[PromptRecord]:
    g = torch.Generator().manual_seed(1)
    return [PromptRecord(torch.randint(23, 96, (int(n),), generator=g).tolist(), str(i), f"p:{i}", f"prompt {i}")
            for i, n in enumerate(torch.randint(2, 7, (k,), generator=g))]


class LocalGenerator:
    """Generator's calls on one engine in this process (no replica to gather over)."""

    sampling = Generator.sampling

    def __init__(self, engine, cfg: RolloutConfig):
        self.engine, self.cfg, self.stop_token_ids, self.rounds = engine, cfg, STOPS, 0

    def extend(self, requests, params):
        self.rounds += 1
        return self.engine.extend(requests, params)

    def end_rounds(self):
        pass

    def collect(self, prompts, *, seed):
        return Rollout(prompts, self.engine.generate([p.prompt_ids for p in prompts], self.sampling(seed=seed)),
                       self.cfg.n_samples)


@dataclass
class Judged:
    score: float


class LengthJudge:
    """A verifier double: a response is right when its length is even."""

    def results(self, rollout):
        return [Judged(float(len(o.token_ids) % 2 == 0)) for o in rollout.outputs]


def setup(engine, *, data=24, mini_batches=2, dynamic=False, **partial):
    cfg = RolloutConfig(prompts_per_step=4, n_samples=3, max_new_tokens=12, temperature=1.0, dynamic_sampling=dynamic,
                        partial=PartialRolloutConfig(enabled=True, **{"round_tokens": 3, **partial}))
    gen = LocalGenerator(engine, cfg)
    return cfg, gen, PartialRollouts(gen, LengthJudge(), cfg, mini_batches=mini_batches, dp=DataParallel(1, 0)), \
        PromptSampler(records(data), cfg.prompts_per_step, seed=5)


def step(collector, sampler, carry, it):
    return collector.collect(sampler, carry, seed=1000 + it, version=it)


def admitted_order(sampler, carry) -> list[int]:
    """The prompts (rows) admitted so far: the sampler's batches from its start."""
    fresh = PromptSampler(sampler.records, sampler.batch_size, seed=sampler.seed)
    return [i for _ in range(carry.admitted // sampler.batch_size) for i in fresh.next_indices()]


def test_groups_train_whole_within_the_staleness_bound_and_every_prompt_once(engine):
    cfg, gen, collector, sampler = setup(engine, data=1000, max_staleness=2, spare_batches=2)
    carry, trained, carried_at_some_step, waited, n = CarryOver(), [], 0, 0, cfg.n_samples
    begun = 0
    for it in range(8):
        rollout, logs = step(collector, sampler, carry, it)
        begun += logs["rollout/samples_generated"]
        assert len(rollout.outputs) == n * len(rollout.prompts) and len(rollout.prompts) >= 2
        for k, o in enumerate(rollout.outputs):
            assert o.prompt_index == k // n
            assert (o.finish_reason == "stop" and o.token_ids[-1] in STOPS) or len(o.token_ids) == cfg.max_new_tokens
            assert len(o.token_versions) == len(o.token_ids) == len(o.logprobs)
            assert it - o.token_versions[0] <= 2, "a token older than max_staleness trained"
            assert o.token_versions == sorted(o.token_versions) and o.token_versions[-1] <= it
        trained += [int(p.answer) for p in rollout.prompts]
        assert logs["partial/groups_trained"] == len(rollout.prompts)
        assert logs["partial/groups_carried"] == len(carry.groups)
        assert all(it + 1 - g.oldest <= 2 for g in carry.groups if g.oldest is not None)  # next step's bound
        carried_at_some_step += len(carry.groups) > 0 and any(s.tokens for g in carry.groups for s in g.samples)
        waited += logs["partial/groups_waited"]
    assert carried_at_some_step >= 5 and waited > 0  # the bound made some step wait for a group
    # Every admitted prompt is trained once or still in flight, in the sampler's order; none is lost.
    flight = [g.index for g in carry.groups]
    assert sorted(trained + flight) == sorted(admitted_order(sampler, carry))
    assert len(set(trained)) == len(trained)
    assert begun == n * len(admitted_order(sampler, carry))  # each response counted once, when begun


@pytest.mark.parametrize("spare,staleness", [(1, 1), (2, 2), (1, 3)])
def test_within_the_bound_every_step_trains_prompts_per_step_groups(engine, spare, staleness):
    """spare_batches <= max_staleness (config/checks.py refuses more, issue 55 item 8): with no
    decode budget every step trains its prompts_per_step groups, the steady state vapo-plan's
    partial-rollout estimate assumes (sizing/step_time.py partial_rollout). With 3 spare batches
    and max_staleness 1, steps trained 4, 12, 4, 12, ... groups here."""
    cfg, gen, collector, sampler = setup(engine, data=1000, spare_batches=spare, max_staleness=staleness)
    carry = CarryOver()
    trained = [len(step(collector, sampler, carry, it)[0].prompts) for it in range(6)]
    assert trained == [cfg.prompts_per_step] * 6


def one_go(engine, cfg, prompt_ids, seed):
    p = SamplingParams(n=1, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, stop_token_ids=STOPS,
                       seed=seed)
    return engine.generate([prompt_ids], p)[0]


def test_carried_responses_are_the_one_go_responses_of_their_seeds(engine):
    cfg, gen, collector, sampler = setup(engine, data=1000, round_tokens=2, max_decode_steps=4, max_staleness=3)
    carry, seen = CarryOver(), {}
    for it in range(6):
        step(collector, sampler, carry, it)
        seen |= {id(g): g for g in carry.groups if any(s.tokens and s.finish is None for s in g.samples)}
    finished = [(g, s) for g in seen.values() for s in g.samples if s.finish is not None and len(s.tokens) > 2]
    assert len(finished) >= 10
    for g, s in finished[:16]:
        whole = one_go(engine, cfg, sampler.records[g.index].prompt_ids, s.seed)
        assert s.tokens == whole.token_ids and s.finish == whole.finish_reason
        assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(whole.logprobs), atol=1e-5)


def test_with_nothing_to_carry_a_step_is_the_synchronous_step(engine):
    """round_tokens = max_new_tokens and no spare batch: one round, every group finished, the sync
    step's prompts and seeds: the same responses as Generator.collect."""
    cfg, gen, collector, sampler = setup(engine, round_tokens=12, spare_batches=0)
    sync = PromptSampler(sampler.records, 4, seed=5)
    carry = CarryOver()
    for it in range(3):
        rollout, logs = step(collector, sampler, carry, it)
        want = gen.collect(sync.next_batch(), seed=1000 + it)
        assert rollout.prompts == want.prompts and not carry.groups and logs["partial/rounds"] == 1
        assert [o.token_ids for o in rollout.outputs] == [o.token_ids for o in want.outputs]
        assert [o.finish_reason for o in rollout.outputs] == [o.finish_reason for o in want.outputs]
        for a, b in zip(rollout.outputs, want.outputs):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def summary(rollout):
    return [(p.source, o.token_ids, o.logprobs, o.token_versions, o.finish_reason)
            for o in rollout.outputs for p in [rollout.prompts[o.prompt_index]]]


def test_the_buffer_file_resumes_the_run_exactly(engine, tmp_path):
    """Four steps, the buffer written and read back with the sampler's state (as a checkpoint holds
    them), four more: the same rollouts, bitwise, as eight steps in one go."""
    cfg, gen, collector, sampler = setup(engine, data=1000, max_decode_steps=3, max_staleness=2)
    carry = CarryOver()
    whole = [summary(step(collector, sampler, carry, it)[0]) for it in range(8)]
    _, _, collector, sampler = setup(engine, data=1000, max_decode_steps=3, max_staleness=2)
    carry = CarryOver()
    first = [summary(step(collector, sampler, carry, it)[0]) for it in range(4)]
    assert any(s.tokens and s.finish is None for g in carry.groups for s in g.samples)
    assert carry_over.write_groups(tmp_path / carry_over.FILE, [carry_over.to_plain(carry.groups)]) == len(carry.groups)
    saved_dp, saved = carry_over.read_groups(tmp_path / carry_over.FILE)
    resumed = CarryOver(carry_over.groups_for_rank(saved, saved_dp, 1, 0), admitted=carry.admitted, drain=True)
    assert carry_over.to_plain(resumed.groups) == carry_over.to_plain(carry.groups)
    _, _, collector, fresh = setup(engine, data=1000, max_decode_steps=3, max_staleness=2)
    fresh.load_state_dict(sampler.state_dict())
    rest = [summary(step(collector, fresh, resumed, it)[0]) for it in range(4, 8)]
    assert first + rest == whole


def test_dynamic_sampling_trains_informative_groups_only(engine):
    cfg, gen, collector, sampler = setup(engine, data=1000, dynamic=True, mini_batches=1)
    carry, dropped = CarryOver(), 0
    for it in range(6):
        rollout, logs = step(collector, sampler, carry, it)
        scores = [r.score for r in rollout.results]
        groups = [scores[k : k + 3] for k in range(0, len(scores), 3)]
        assert rollout.results == LengthJudge().results(rollout)
        assert sum(len(set(g)) == 1 for g in groups) == logs["rollout/groups_topped_up"]
        dropped += logs["rollout/groups_dropped"]
    assert dropped > 0


def test_a_stale_buffer_restarts_and_a_drain_finishes_everything(engine):
    """A sample older than max_staleness (a buffer saved under a larger bound) starts over from its
    prompt with the current weights; with partial rollout off, the next step trains every group."""
    cfg, gen, collector, sampler = setup(engine, data=1000, max_decode_steps=2, max_staleness=3)
    carry = CarryOver()
    for it in range(3):
        step(collector, sampler, carry, it)
    old = [(g.key, j) for g in carry.groups for j, s in enumerate(g.samples) if s.oldest is not None and s.oldest < 2]
    assert old
    cfg2 = replace(cfg, partial=replace(cfg.partial, max_staleness=1))
    tight = PartialRollouts(gen, LengthJudge(), cfg2, mini_batches=2, dp=DataParallel(1, 0))
    rollout, logs = tight.collect(sampler, carry, seed=7, version=3)
    assert logs["partial/samples_restarted"] == len(old)
    assert logs["rollout/samples_generated"] == logs["partial/groups_admitted"] * cfg.n_samples + len(old)
    assert all(o.token_versions[0] >= 2 for o in rollout.outputs) and all(
        s.oldest is None or s.oldest >= 2 for g in carry.groups for s in g.samples)
    # Drain: partial rollout off; the carried groups and one new batch are all trained.
    before = len(carry.groups)
    assert before
    off = replace(cfg, partial=replace(cfg.partial, enabled=False))
    rollout, logs = PartialRollouts(gen, LengthJudge(), off, mini_batches=2, dp=DataParallel(1, 0)).collect(
        sampler, carry, seed=8, version=4)
    assert not carry.groups and len(rollout.prompts) == before + 4 and logs["partial/groups_admitted"] == 4
    assert all(o.finish_reason == "stop" or len(o.token_ids) == 12 for o in rollout.outputs)
