"""The trainer's own forwards and updates of one step on a fixed batch that is uneven across
data-parallel ranks, at any layout, for the tests of micro-batch planning (issue 63):
tests/distributed/test_micro_batch_plans.py and test_plan_search.py.

    models(path, moe)            a tiny Qwen2 (4 layers) or Qwen3-MoE actor and its critic, HF directories
    step(actor, critic, tp, pp, vpp, ep, moe, sp)   on each rank: Actor.log_probs, Critic.values, GAE, the
                                 critic's and the actor's updates (two mini-batches); its rows' results
    gathered(per_rank)           the ranks' results as one run's
    same(got, ref)               equal to the single-process run, within float32 tolerance

The batch: 16 responses in 8 groups of 2; groups alternate in pairs between short (6-8 tokens)
and long (20-24), and DP rank r of D takes its part of each mini-batch (groups 4k + r*4/D ...), so
the ranks' k-th mini-batches make up the single process's k-th and their lengths differ.
"""

from __future__ import annotations

import torch

VOCAB = 250
BUDGET = 24  # micro_batch_tokens: 3 sequences of <= 8 tokens fit in one micro-batch, one of >= 20
SHORT, LONG = [7, 8, 6, 8], [24, 20, 23, 21]  # one pair of groups (2 responses each)


def models(tmp_path, moe: bool):
    """Experts in every MoE layer: SGLang's Qwen3-MoE builds no dense layer, so vapo-plan refuses one."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config

    from tests.helpers.tiny_hf import qwen3_moe_config

    torch.manual_seed(0)
    cfg = qwen3_moe_config(vocab=VOCAB, mlp_only_layers=()) if moe else Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    actor = AutoModelForCausalLM.from_config(cfg).float()
    actor.save_pretrained(tmp_path / "actor")
    critic = AutoModelForTokenClassification.from_config(type(cfg)(**{**cfg.to_dict(), "num_labels": 1})).float()
    critic.model.load_state_dict(actor.model.state_dict())
    critic.save_pretrained(tmp_path / "critic")
    return str(tmp_path / "actor"), str(tmp_path / "critic")


ROWS = 16


def rank_rows(rank: int, dp: int) -> list[int]:
    """DP rank `rank`'s rows: 4 // dp groups of each of the two mini-batches (groups 0-3 and 4-7), so
    its k-th mini-batch (its first or second half) is its part of the single process's k-th. At DP=2
    rank 0 holds the short groups 0, 1, 4, 5 and rank 1 the long ones."""
    per = 4 // dp
    groups = [k * 4 + rank * per + j for k in (0, 1) for j in range(per)]
    return [2 * g + i for g in groups for i in (0, 1)]


def batch_of(moe: bool):
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
    if moe:  # the engine's routes: two distinct experts of four per token and MoE layer (all 4 layers)
        scores = torch.rand(ROWS, tokens.shape[1], 4, 4, generator=g)
        batch.routes = scores.topk(2, dim=-1).indices.to(torch.uint8)
    return batch


def step(actor_dir, critic_dir, tp, pp, vpp, ep, moe, sp=False):
    from megatron.core import dist_checkpointing  # noqa: F401  (import order: megatron first)

    from vapo_megatron.algorithms.advantages import compute_advantages
    from vapo_megatron.config import (
        AlgoConfig,
        Config,
        ModelConfig,
        OptimConfig,
        ParallelConfig,
        RolloutConfig,
        TrainerConfig,
    )
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.actor import Actor, PolicyLossSettings
    from vapo_megatron.mcore.critic import build_critic
    from vapo_megatron.mcore.model import build_model
    from vapo_megatron.mcore.update import UpdateSettings
    from vapo_megatron.weights.params import iter_hf_tensors

    optim = OptimConfig(lr=1e-3, adam_eps=1.0, clip_grad=0.0)  # eps 1: Adam's first step ~ lr * g, scale-sensitive
    cfg = Config(model=ModelConfig(hf_path=actor_dir, critic_hf_path=critic_dir, dtype="float32"),
                 parallel=ParallelConfig(tp=tp, pp=pp, vpp=vpp, ep=ep, sequence_parallel=sp), actor_optim=optim,
                 critic_optim=optim, algo=AlgoConfig(mini_batches=2, alpha=1.0),
                 rollout=RolloutConfig(routing_replay=True if moe else False),
                 trainer=TrainerConfig(micro_batch_tokens=BUDGET, seed=5))
    parallel.init_distributed(tp, pp, vpp, ep=ep, seed=5)
    batch = batch_of(moe)
    mine = rank_rows(parallel.dp_rank(), parallel.dp_size())
    batch = batch.select(mine)
    updates = UpdateSettings(mini_batches=2, epochs=1, max_tokens=BUDGET, max_consecutive_skips=3)
    actor = Actor(build_model(cfg, critic=False), PolicyLossSettings(
        eps_low=0.2, eps_high=0.28, dual_clip_c=None, loss_agg="token", nll_coef=0.1, temperature=1.0,
        chunk_tokens=16), updates)
    critic = build_critic(cfg, updates)
    batch.old_logp, entropy, logs = actor.log_probs(batch)
    batch.values = critic.values(batch)
    batch.advantages, batch.returns = compute_advantages(batch, cfg.algo, value_pretrain=False)
    critic_logs = critic.update(batch, value_pretrain=False)
    actor_logs = actor.update(batch)
    weights = {role: {k: v.clone() for k, v in iter_hf_tensors(m.modules, m.family, m.hf_cfg, critic=m.critic)}
               for role, m in (("actor", actor.model), ("critic", critic.model))}
    return {"rows": mine, "logp": batch.old_logp, "values": batch.values, "entropy": entropy, "weights": weights,
            "grad_norms": (actor_logs["actor/grad_norm"], critic_logs["critic/grad_norm"]), "logs": logs}


def gathered(per_rank: list[dict]) -> dict:
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


def same(got: dict, ref: dict) -> None:
    for key in ("logp", "values"):
        for row, want in ref[key].items():
            width = min(len(want), len(got[key][row]))
            torch.testing.assert_close(got[key][row][:width], want[:width], rtol=1e-5, atol=1e-6,
                                       msg=f"{key} row {row}")
    for role in ("actor", "critic"):
        assert set(got["weights"][role]) == set(ref["weights"][role])
        for name, want in ref["weights"][role].items():
            torch.testing.assert_close(got["weights"][role][name], want, rtol=1e-5, atol=1e-7, msg=f"{role} {name}")
    torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-4, atol=0)
