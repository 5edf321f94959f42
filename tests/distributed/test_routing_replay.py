"""Routing replay (issue 46): the trainer's routers take the rollout engine's routes.

The tiny Qwen3-MoE (tests/helpers/tiny_hf.py qwen3_moe_config: 4 experts, top-2, layer 2 dense)
gets near-tied router rows (experts 0, 1, 2), and its embedded engine picks experts from bfloat16-
rounded scores (tests/helpers/moe_routes.py): engine and trainer disagree on some tokens' routes.
One 2-rank run builds the actor at EP=1 (DP=2), EP=2, TP=2 with sequence parallelism (and full
recomputation) and PP=2 (recomputation, 1F1B over several micro-batches), and in each:
  - step 4's log-probs with replay: every router's top-k (its routing map) equals the engine's on
    every token and the log-probs equal the engine's to float32 rounding; moe/routing_mismatch
    (the routers' own choice against the engine's) is > 0. Without replay the routes and the
    log-probs differ;
  - the PPO + NLL gradient with replay over token-budget micro-batches equals the one-micro-batch
    gradient, and the SGD step equals a single-process reference: transformers' Qwen3-MoE routed
    by the engine's routes (the formulas written out, as tests/distributed/test_layout_invariance.py).
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from tests.helpers.dist_utils import run_ranks

VOCAB = 250  # padded by Megatron (to 256 at TP=1, 512 at TP=2)
LR, MU, EPS_LOW, EPS_HIGH = 0.5, 0.1, 0.2, 0.28
BUDGET = 40  # tokens per micro-batch: 2-4 micro-batches per rank
LAYOUTS = {"ep1": dict(tp=1, pp=1, ep=1), "ep2": dict(tp=1, pp=1, ep=2),  # (tp, pp, ep, SP + recompute)
           "tp2_sp": dict(tp=2, pp=1, ep=1, sp=True, recompute=True), "pp2": dict(tp=1, pp=2, ep=1, recompute=True)}


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """The actor's HF directory and a batch sampled by its engine (routes, log-probs), with fixed
    advantages and correctness flags."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.moe_routes import bf16_selection, near_tie
    from tests.helpers.tiny_hf import qwen3_moe_config, randomize
    from vapo_megatron.data.batch import RolloutBatch, pack_sequences, pad_ragged, to_sequence
    from vapo_megatron.rollout.base import SamplingParams
    from vapo_megatron.rollout.embedded import EmbeddedEngine
    from vapo_megatron.rollout.routes import pack_routes

    hf_dir = tmp_path_factory.mktemp("replay") / "actor"
    model = AutoModelForCausalLM.from_config(qwen3_moe_config(vocab=VOCAB), dtype=torch.float32)
    randomize(model, seed=11)
    near_tie(model)
    model.save_pretrained(hf_dir)
    bf16_selection(model)
    engine = EmbeddedEngine(model, eos_token_ids=[2])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(3, 9, (8,), generator=g)]
    outs = engine.generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=10, seed=3, return_routes=True))
    tokens, pl, rl = pack_sequences(prompts, [o.token_ids for o in outs])
    S, B = tokens.shape[1], len(outs)
    batch = RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=torch.zeros(B),
                         correct=torch.rand(B, generator=g) < 0.5, group_ids=torch.arange(B) // 2,
                         routes=pack_routes([o.routes for o in outs], S, 2))
    batch.old_logp = to_sequence(pad_ragged([o.logprobs for o in outs]), pl, rl, S)  # the engine's
    batch.advantages = to_sequence(torch.randn(B, int(rl.max()), generator=g), pl, rl, S)
    return hf_dir, batch


def _used_routes(replay, seen: list) -> list:
    """Forward hooks that record what each router call routed to (its routing map [tokens, E])."""
    return [router.register_forward_hook(lambda m, a, out, c=column: seen.append((c, out[1].detach().cpu())))
            for routers in replay.routers for column, router in routers]


def _engine_map(mb, column: int, width: int, num_experts: int) -> torch.Tensor:
    """The engine's routes of a micro-batch as megatron's routing map on this rank: [tokens, E], sequence-
    major, this TP rank's positions under sequence parallelism (independent of routing_replay.py)."""
    from vapo_megatron.mcore import parallel

    routes = mb.routes[:, :, column].long()
    k = routes.shape[-1]
    routes = torch.cat([routes, torch.arange(k).expand(mb.size, width - routes.shape[1], k)], dim=1)
    if parallel.tp_size() > 1:
        part = width // parallel.tp_size()
        routes = routes[:, parallel.tp_rank() * part:(parallel.tp_rank() + 1) * part]
    idx = routes.transpose(0, 1).reshape(-1, k)
    return torch.zeros(idx.shape[0], num_experts, dtype=torch.bool).scatter_(1, idx, True)


def _layout(hf_dir, batch, tp, pp, ep, sp=False, recompute=False) -> dict:
    from pathlib import Path

    import model_providers
    from vapo_megatron.config import OptimConfig
    from vapo_megatron.data.microbatch import plan_micro_batches
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.actor import Actor, PolicyLossSettings, policy_loss
    from vapo_megatron.mcore.model import TrainModel, wrap_ddp
    from vapo_megatron.mcore.models import build_actor
    from vapo_megatron.mcore.optimizer import build_optimizer, optimizer_step
    from vapo_megatron.mcore.routing_replay import RouteReplay
    from vapo_megatron.mcore.schedule import forward_backward, reduce_metric_sums
    from vapo_megatron.mcore.update import UpdateSettings, global_counts
    from vapo_megatron.weights.hf_read import load_hf_weights
    from vapo_megatron.weights.params import iter_hf_tensors

    parallel.init_distributed(tp, pp, ep=ep, seed=7)
    hf_cfg = model_providers.read_hf_config(hf_dir)
    family = model_providers.family_for(hf_cfg)
    chunks = [build_actor(hf_cfg, params_dtype=torch.float32, sequence_parallel=sp, recompute=recompute)]
    load_hf_weights(chunks, family, hf_cfg, hf_dir)
    chunks = wrap_ddp(chunks, distributed_optimizer=False)
    opt = build_optimizer(chunks, OptimConfig(lr=LR, clip_grad=0.0), params_dtype=torch.float32, kind="sgd")
    replay = RouteReplay(chunks, hf_cfg)
    settings = PolicyLossSettings(eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip_c=None, loss_agg="token", nll_coef=MU,
                                  temperature=1.0, chunk_tokens=16)
    actor = Actor(TrainModel(chunks, opt, None, family, hf_cfg, Path(hf_dir), False, "float32", replay=replay), settings,
                  UpdateSettings(mini_batches=1, epochs=1, max_tokens=10**6, max_consecutive_skips=1))
    rows = list(range(batch.size)) if parallel.dp_size() == 1 else [range(4), range(4, 8)][parallel.dp_rank()]
    b = batch.select(list(rows))
    out = {}
    for on in (True, False):  # step 4, one micro-batch: the routes every router used
        replay.enabled, seen = on, []
        hooks = _used_routes(replay, seen)
        logp, _, logs = actor.log_probs(b)
        for hook in hooks:
            hook.remove()
        mb = b.select(plan_micro_batches(b.seq_lens.tolist(), 10**6)[0])  # the micro-batch's row order
        width = -(-mb.tokens.shape[1] // tp) * tp
        differ = [int((m != _engine_map(mb, c, width, 4)).any(-1).sum()) for c, m in seen]
        out["on" if on else "off"] = dict(logp=logp, mismatch=logs["moe/routing_mismatch"], used=differ, rows=list(rows))
    replay.enabled = True
    counts = global_counts(b)
    loss = partial(policy_loss, settings=settings, counts=counts, vocab_size=VOCAB)
    for name, budget in (("one", 10**6), ("budget", BUDGET)):
        plan = plan_micro_batches(b.seq_lens.tolist(), budget)
        sums = reduce_metric_sums(forward_backward(chunks, loss, [b.select(r) for r in plan], forward_only=False,
                                                   replay=replay))
        out[name] = dict(micro=len(plan), sums=sums,
                         grads={n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()})
    applied, _ = optimizer_step(opt, chunks, loss_finite=True)
    assert applied
    out["params"] = {k: v.clone() for k, v in iter_hf_tensors([c.module for c in chunks], family, hf_cfg)}
    return out


def _run(hf_dir, batch) -> dict:
    from megatron.core import parallel_state as ps

    out = {}
    for tag, layout in LAYOUTS.items():
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        out[tag] = _layout(hf_dir, batch, **layout)
    return out


def _reference(hf_dir, batch) -> dict:
    """One SGD step of transformers' Qwen3-MoE routed by the engine's routes, on the whole batch."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.moe_routes import forced
    from vapo_megatron.data.batch import shifted_targets
    from vapo_megatron.rollout.embedded import expert_views

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    forced(model, batch.routes)
    mask, A = batch.mask, batch.advantages
    N, N_pos = mask.sum(), (mask * batch.correct[:, None]).sum()
    logp = torch.log_softmax(model(batch.tokens).logits.float(), -1).gather(-1, shifted_targets(batch.tokens)[..., None])[..., 0]
    ratio = torch.exp(logp - batch.old_logp)
    term = -torch.minimum(ratio * A, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * A)
    ((term * mask).sum() / N - MU * (logp * mask * batch.correct[:, None]).sum() / N_pos).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    state = model.state_dict()  # transformers 5's fused experts as the per-expert names the export writes
    fused = [k for k in state if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    return {k: v.detach().clone() for k, v in {**state, **expert_views(state)}.items() if k not in fused}, logp.detach()


@pytest.fixture(scope="module")
def runs(rollout):
    hf_dir, batch = rollout
    return run_ranks(2, _run, hf_dir, batch)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replayed_routes_are_the_engines_and_give_its_log_probs(rollout, runs, layout):
    _, batch = rollout
    for rank in runs:
        on, off = rank[layout]["on"], rank[layout]["off"]
        b = batch.select(on["rows"])
        assert on["used"] and all(d == 0 for d in on["used"]), on["used"]  # every router, every token
        assert sum(off["used"]) > 0  # the trainer's own routers choose otherwise somewhere
        assert on["mismatch"] > 0 and off["mismatch"] > 0  # what moe/routing_mismatch reports
        diff_on = ((on["logp"] - b.old_logp).abs() * b.mask).max()
        diff_off = ((off["logp"] - b.old_logp).abs() * b.mask).max()
        assert diff_on < 2e-5, diff_on  # float32 rounding: the same network as the engine's
        assert diff_off > 1e-2, diff_off


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replayed_gradients_match_micro_batches_and_the_reference(rollout, runs, layout):
    from safetensors.torch import load_file

    hf_dir, batch = rollout
    want, _ = _reference(hf_dir, batch)
    initial = load_file(os.path.join(hf_dir, "model.safetensors"))
    got = {}
    for rank in runs:
        r = rank[layout]
        assert r["budget"]["micro"] > 1 and r["one"]["micro"] == 1
        for k, v in r["one"]["sums"].items():
            assert abs(v - r["budget"]["sums"][k]) <= 1e-5 * max(1.0, abs(v)), k
        for n, g in r["one"]["grads"].items():
            torch.testing.assert_close(r["budget"]["grads"][n], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
        got.update(r["params"])
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        d_have, d_want = got[name] - initial[name], w - initial[name]
        assert (d_have - d_want).norm() / d_want.norm().clamp(min=1e-12) < 1e-3, name
