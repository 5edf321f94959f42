"""Micro-batch counts that agree wherever a collective depends on them (issue 63).

The trainer's own step-4 forwards (Actor.log_probs, Critic.values) and its updates (optimize, two
mini-batches) on data that is uneven across the two ranks: rank 0 holds short sequences (3
micro-batches at the token budget in a forward, 2 per mini-batch), rank 1 long ones (8 and 4), so
each rank's own plan differs.
- EP=2 (Qwen3-MoE actor and critic, routing replay on): the MoE dispatcher's all-to-all pairs
  across DP ranks in every forward, so both ranks must run the same count. Before the fix the
  ranks planned 3 and 8 micro-batches and deadlocked.
- PP=2 with VPP=2 (dense): megatron's interleaved schedule refuses a count that is not a multiple
  of PP. Before the fix the forward's plan of 11 raised "The remainder of M ...".
- DP=2 (dense): no forward crosses DP, so the ranks keep their own plans; the control.
Each layout's log-probs, values and the weights after both updates equal a single-process run
of the same code on the whole batch.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist_utils import run_ranks
from tests.helpers.micro_batch_step import gathered, models, same, step


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    actor, critic = models(tmp_path_factory.mktemp("dense"), moe=False)
    return actor, critic, gathered(run_ranks(1, step, actor, critic, 1, 1, None, 1, False))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    actor, critic = models(tmp_path_factory.mktemp("moe"), moe=True)
    return actor, critic, gathered(run_ranks(1, step, actor, critic, 1, 1, None, 1, True))


def test_expert_parallel_ranks_run_the_same_count_with_uneven_data(moe):
    """EP=2 over two DP ranks, routing replay on, actor and critic MoE: one rank plans 3 micro-batches
    per forward, the other 8; the agreed count is 8 on both (a hang before the fix: timeout)."""
    actor, critic, ref = moe
    same(gathered(run_ranks(2, step, actor, critic, 1, 1, None, 2, True, timeout=240)), ref)


def test_interleaved_pipeline_takes_a_multiple_of_pp(dense):
    """PP=2 x VPP=2, one DP rank holding all 16 rows: the forward plans 11 micro-batches (3 for the 8
    short rows, 8 long), rounded up to 12 for megatron's interleaved schedule."""
    actor, critic, ref = dense
    same(gathered(run_ranks(2, step, actor, critic, 1, 2, 2, 1, False, timeout=240)), ref)


def test_data_parallel_ranks_keep_their_own_plans(dense):
    actor, critic, ref = dense
    same(gathered(run_ranks(2, step, actor, critic, 1, 1, None, 1, False, timeout=240)), ref)


def test_a_rank_with_fewer_rows_than_the_count_runs_fillers(monkeypatch):
    """The planner side alone: 3 rows against an agreed count of 5 give 3 real micro-batches and two
    fillers with no response token (no loss, no count); every row once."""
    from vapo_megatron.data.batch import RolloutBatch, pack_sequences
    from vapo_megatron.mcore import parallel, update

    tokens, pl, rl = pack_sequences([[1, 2]] * 3, [[3, 4, 5]] * 3)
    batch = RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=torch.ones(3),
                         correct=torch.ones(3, dtype=torch.bool), group_ids=torch.arange(3))
    monkeypatch.setattr(update, "forward_crosses_dp", lambda: True)
    monkeypatch.setattr(parallel, "agree_max", lambda n: 5)
    monkeypatch.setattr(update, "micro_batch_multiple", lambda: 1)
    plan, micro = update.micro_batches(batch, max_tokens=100)  # alone: one micro-batch of all 3
    assert len(micro) == 5 and sorted(r for rows in plan for r in rows) == [0, 1, 2] and plan[3:] == [[], []]
    for fill in micro[3:]:
        assert float(fill.mask.sum()) == 0 and not bool(fill.correct.any()) and fill.tokens.shape == (1, 5)
    # perf/padding_ratio is that plan's: 3 x 5 real tokens, and the two fillers' 2 prompt tokens each
    # processed for nothing (the unagreed plan, one micro-batch of 3 equal rows, would say 0).
    assert update.padding_ratio(batch, max_tokens=100) == pytest.approx(4 / 19)
    monkeypatch.setattr(parallel, "agree_max", lambda n: 1)
    monkeypatch.setattr(update, "micro_batch_multiple", lambda: 2)  # VPP at PP=2: 1 -> 2
    plan, micro = update.micro_batches(batch, max_tokens=100)
    assert [len(rows) for rows in plan] == [2, 1] and len(micro) == 2
