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

VOCAB = 250
BUDGET = 24  # micro_batch_tokens: 3 sequences of <= 8 tokens fit in one micro-batch, one of >= 20
SHORT, LONG = [7, 8, 6, 8], [24, 20, 23, 21]  # one pair of groups (2 responses each)


def _models(tmp_path, moe: bool):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config

    from tests.helpers.tiny_hf import qwen3_moe_config

    torch.manual_seed(0)
    cfg = qwen3_moe_config(vocab=VOCAB) if moe else Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    actor = AutoModelForCausalLM.from_config(cfg).float()
    actor.save_pretrained(tmp_path / "actor")
    critic = AutoModelForTokenClassification.from_config(type(cfg)(**{**cfg.to_dict(), "num_labels": 1})).float()
    critic.model.load_state_dict(actor.model.state_dict())
    critic.save_pretrained(tmp_path / "critic")
    return str(tmp_path / "actor"), str(tmp_path / "critic")


ROWS = 16
# Groups 0, 1, 4, 5 short (DP rank 0's), 2, 3, 6, 7 long (rank 1's): each rank's k-th mini-batch
# (the first or second half of its groups) is then its half of the single process's k-th (groups 0-3, 4-7).
RANK_ROWS = ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])


def _batch(moe: bool):
    """16 responses in 8 groups of 2, short and long groups as RANK_ROWS deals them."""
    from vapo_megatron.data.batch import RolloutBatch, pack_sequences

    g = torch.Generator().manual_seed(3)
    lens = SHORT + LONG + SHORT + LONG
    prompts = [torch.randint(1, VOCAB, (2,), generator=g).tolist() for _ in lens]
    responses = [torch.randint(1, VOCAB, (n - 2,), generator=g).tolist() for n in lens]
    tokens, pl, rl = pack_sequences(prompts, responses)
    correct = torch.tensor([i % 3 == 0 for i in range(ROWS)])
    batch = RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=correct.float() * 2 - 1,
                         correct=correct, group_ids=torch.arange(ROWS) // 2)
    if moe:  # the engine's routes: two distinct experts of four per token and MoE layer (3 of 4 layers)
        scores = torch.rand(ROWS, tokens.shape[1], 3, 4, generator=g)
        batch.routes = scores.topk(2, dim=-1).indices.to(torch.uint8)
    return batch


def _step(actor_dir, critic_dir, tp, pp, vpp, ep, moe):
    from megatron.core import dist_checkpointing  # noqa: F401  (import order: megatron first)

    from vapo_megatron.algorithms.advantages import compute_advantages
    from vapo_megatron.config import AlgoConfig, Config, ModelConfig, OptimConfig, ParallelConfig, RolloutConfig
    from vapo_megatron.config import TrainerConfig
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.actor import Actor, PolicyLossSettings
    from vapo_megatron.mcore.critic import build_critic
    from vapo_megatron.mcore.model import build_model
    from vapo_megatron.mcore.update import UpdateSettings
    from vapo_megatron.weights.params import iter_hf_tensors

    optim = OptimConfig(lr=1e-3, adam_eps=1.0, clip_grad=0.0)  # eps 1: Adam's first step ~ lr * g, scale-sensitive
    cfg = Config(model=ModelConfig(hf_path=actor_dir, critic_hf_path=critic_dir, dtype="float32"),
                 parallel=ParallelConfig(tp=tp, pp=pp, vpp=vpp, ep=ep), actor_optim=optim, critic_optim=optim,
                 algo=AlgoConfig(mini_batches=2, alpha=1.0), rollout=RolloutConfig(routing_replay=True if moe else False),
                 trainer=TrainerConfig(micro_batch_tokens=BUDGET, seed=5))
    parallel.init_distributed(tp, pp, vpp, ep=ep, seed=5)
    batch = _batch(moe)
    mine = RANK_ROWS[parallel.dp_rank()] if parallel.dp_size() == 2 else list(range(ROWS))
    batch = batch.select(mine)
    updates = UpdateSettings(mini_batches=2, epochs=1, max_tokens=BUDGET, max_consecutive_skips=3)
    actor = Actor(build_model(cfg, critic=False), PolicyLossSettings(
        eps_low=0.2, eps_high=0.28, dual_clip_c=None, loss_agg="token", nll_coef=0.1, temperature=1.0,
        chunk_tokens=16), updates)
    critic = build_critic(cfg, updates)
    batch.old_logp, entropy, logs = actor.log_probs(batch)
    batch.values = critic.values(batch)
    batch.advantages, batch.returns = compute_advantages(batch, cfg.algo, value_pretrain=False)
    critic_logs = critic.update(batch)
    actor_logs = actor.update(batch)
    weights = {role: {k: v.clone() for k, v in iter_hf_tensors(m.modules, m.family, m.hf_cfg, critic=m.critic)}
               for role, m in (("actor", actor.model), ("critic", critic.model))}
    return {"rows": mine, "logp": batch.old_logp, "values": batch.values, "entropy": entropy, "weights": weights,
            "grad_norms": (actor_logs["actor/grad_norm"], critic_logs["critic/grad_norm"]), "logs": logs}


def _gathered(per_rank: list[dict]) -> dict:
    """The ranks' results as one run's: rows stitched in order, each weight from a rank that holds it."""
    out = {"logp": {}, "values": {}, "weights": {"actor": {}, "critic": {}}}
    for r in per_rank:
        for i, row in enumerate(r["rows"]):
            for key in ("logp", "values"):
                out[key][row] = r[key][i]
        for role in ("actor", "critic"):
            out["weights"][role].update(r["weights"][role])
    out["grad_norms"] = per_rank[0]["grad_norms"]
    return out


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    actor, critic = _models(tmp_path_factory.mktemp("dense"), moe=False)
    return actor, critic, _gathered(run_ranks(1, _step, actor, critic, 1, 1, None, 1, False))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    actor, critic = _models(tmp_path_factory.mktemp("moe"), moe=True)
    return actor, critic, _gathered(run_ranks(1, _step, actor, critic, 1, 1, None, 1, True))


def _same(got: dict, ref: dict) -> None:
    for key in ("logp", "values"):
        for row, want in ref[key].items():
            width = min(len(want), len(got[key][row]))
            torch.testing.assert_close(got[key][row][:width], want[:width], rtol=1e-5, atol=1e-6, msg=f"{key} row {row}")
    for role in ("actor", "critic"):
        assert set(got["weights"][role]) == set(ref["weights"][role])
        for name, want in ref["weights"][role].items():
            torch.testing.assert_close(got["weights"][role][name], want, rtol=1e-5, atol=1e-7, msg=f"{role} {name}")
    torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-4, atol=0)


def test_expert_parallel_ranks_run_the_same_count_with_uneven_data(moe):
    """EP=2 over two DP ranks, routing replay on, actor and critic MoE: one rank plans 3 micro-batches
    per forward, the other 8; the agreed count is 8 on both (a hang before the fix: timeout)."""
    actor, critic, ref = moe
    _same(_gathered(run_ranks(2, _step, actor, critic, 1, 1, None, 2, True, timeout=240)), ref)


def test_interleaved_pipeline_takes_a_multiple_of_pp(dense):
    """PP=2 x VPP=2, one DP rank holding all 16 rows: the forward plans 11 micro-batches (3 for the 8
    short rows, 8 long), rounded up to 12 for megatron's interleaved schedule."""
    actor, critic, ref = dense
    _same(_gathered(run_ranks(2, _step, actor, critic, 1, 2, 2, 1, False, timeout=240)), ref)


def test_data_parallel_ranks_keep_their_own_plans(dense):
    actor, critic, ref = dense
    _same(_gathered(run_ranks(2, _step, actor, critic, 1, 1, None, 1, False, timeout=240)), ref)


def test_a_rank_with_fewer_rows_than_the_count_runs_fillers(monkeypatch):
    """The planner side alone: 3 rows against an agreed count of 5 give 3 real micro-batches and two
    fillers with no response token (no loss, no count); every row once."""
    from vapo_megatron.data.batch import RolloutBatch, pack_sequences
    from vapo_megatron.mcore import parallel, update

    tokens, pl, rl = pack_sequences([[1, 2]] * 3, [[3, 4, 5]] * 3)
    batch = RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=torch.ones(3),
                         correct=torch.ones(3, dtype=torch.bool), group_ids=torch.arange(3))
    monkeypatch.setattr(parallel, "forward_crosses_dp", lambda: True)
    monkeypatch.setattr(parallel, "agree_max", lambda n: 5)
    monkeypatch.setattr(parallel, "micro_batch_multiple", lambda: 1)
    plan, micro = update.micro_batches(batch, max_tokens=100)  # alone: one micro-batch of all 3
    assert len(micro) == 5 and sorted(r for rows in plan for r in rows) == [0, 1, 2] and plan[3:] == [[], []]
    for fill in micro[3:]:
        assert float(fill.mask.sum()) == 0 and not bool(fill.correct.any()) and fill.tokens.shape == (1, 5)
    monkeypatch.setattr(parallel, "agree_max", lambda n: 1)
    monkeypatch.setattr(parallel, "micro_batch_multiple", lambda: 2)  # VPP at PP=2: 1 -> 2
    plan, micro = update.micro_batches(batch, max_tokens=100)
    assert [len(rows) for rows in plan] == [2, 1] and len(micro) == 2
