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
    from vapo_megatron.data.routes import pack_routes
    from vapo_megatron.rollout.base import SamplingParams
    from vapo_megatron.rollout.embedded import EmbeddedEngine

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


def _mine(x: torch.Tensor, width: int) -> torch.Tensor:
    """This TP rank's sequence positions of x [width, ...] under sequence parallelism."""
    from vapo_megatron.mcore import parallel

    part = width // parallel.tp_size()
    return x[parallel.tp_rank() * part:(parallel.tp_rank() + 1) * part]


def _unrouted(mb, width: int) -> torch.Tensor:
    """[tokens] bool, sequence-major, this TP rank's positions: the tokens the engine did not route
    (position >= sequence length - 1: the last token and the padding)."""
    return _mine(torch.arange(width).unsqueeze(1) >= (mb.seq_lens - 1).unsqueeze(0), width).reshape(-1)


def _engine_map(mb, column: int, width: int, num_experts: int) -> torch.Tensor:
    """The engine's routes of a micro-batch as megatron's routing map on this rank: [tokens, E], sequence-
    major, this TP rank's positions under sequence parallelism; the c-th token (in the micro-batch's
    sequence-major order) that the engine did not route goes to experts (c k + j) mod E (issue 55
    item 4). Independent of routing_replay.py."""
    routes = mb.routes[:, :, column].long()
    k = routes.shape[-1]
    routes = torch.cat([routes, torch.zeros(mb.size, width - routes.shape[1], k, dtype=torch.long)], dim=1)
    seq = routes.transpose(0, 1)  # [S, b, k]
    unrouted = torch.arange(width).unsqueeze(1) >= (mb.seq_lens - 1).unsqueeze(0)  # [S, b]
    c = (unrouted.flatten().cumsum(0) - 1).view(width, mb.size, 1)
    seq = torch.where(unrouted.unsqueeze(-1), (c * k + torch.arange(k)) % num_experts, seq)
    idx = _mine(seq, width).reshape(-1, k)
    return torch.zeros(idx.shape[0], num_experts, dtype=torch.bool).scatter_(1, idx, True)


def _transfers(replay, chunk, mb, width: int) -> dict:
    """Issue 55 item 3, with the routers' device played by the meta device (there is no second
    device here): the copies between devices while a forward replays mb's routes and the backward's
    recomputed forward replays them again, each router taking its indices as megatron's do
    (RouterReplay.get_replay_topk: `top_indices.to(scores.device)`, then a gather)."""
    from torch.overrides import TorchFunctionMode

    copies: list = []

    class Copies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func in (torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cuda) and isinstance(out, torch.Tensor):
                src = args[1] if func is torch.Tensor.copy_ else args[0]
                if src.device != out.device:
                    copies.append(bool(kwargs.get("non_blocking")))
            return out

    routers = [router.router_replay for _, router in replay.routers[0]]
    replay.device, targets = torch.device("meta"), []
    try:
        with torch.enable_grad(), Copies():
            with replay.forward(chunk, mb, width):
                for r in routers:
                    targets.append(r.target_topk_idx)
                    r.get_replay_topk(torch.zeros(r.target_topk_idx.shape[0], 4, device="meta"), 2)
            for r in routers:  # the recomputed forward, in the backward
                r.get_replay_topk(torch.zeros(r.replay_backward_list[0].shape[0], 4, device="meta"), 2)
    finally:
        replay.finish()
        replay.device = torch.device("cpu")
    return {"routers": len(routers), "copies": copies, "targets": [(str(t.device), t.dtype) for t in targets]}


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
    actor = Actor(TrainModel(chunks, opt, None, family, hf_cfg, Path(hf_dir), False, "float32", replay=replay),
                  settings, UpdateSettings(mini_batches=1, epochs=1, max_tokens=10**6, max_consecutive_skips=1))
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
        padding = sum((m[_unrouted(mb, width)].sum(0) for _, m in seen), torch.zeros(4, dtype=torch.long))  # [E]
        out["on" if on else "off"] = dict(logp=logp, mismatch=logs["moe/routing_mismatch"], used=differ,
                                          rows=list(rows), padding=padding.tolist())
    replay.enabled = True
    if sp:
        out["transfers"] = _transfers(replay, chunks[0], mb, width)
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
    logp = (torch.log_softmax(model(batch.tokens).logits.float(), -1)
            .gather(-1, shifted_targets(batch.tokens)[..., None])[..., 0])
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
def test_padding_routes_spread_over_the_ep_ranks(runs, layout):
    """Issue 55 item 4: the tokens the engine did not route (each sequence's last token, the padding)
    are routed by the routers over every expert: at EP=2 (experts 0-1 on EP rank 0, 2-3 on rank 1)
    each EP rank takes about half (experts 0..k-1 for all of them put every rank's on rank 0)."""
    per_expert = [sum(rank[layout]["on"]["padding"][e] for rank in runs) for e in range(4)]  # both ranks' tokens
    halves = [sum(per_expert[:2]), sum(per_expert[2:])]
    assert min(halves) / max(halves) > 0.6, per_expert


def test_a_micro_batchs_routes_reach_the_device_in_one_non_blocking_copy(runs):
    """Issue 55 item 3: one copy to the device per micro-batch forward, non-blocking, for every router
    and for the recomputed forward too (TP=2 with sequence parallelism and recomputation); each router's
    indices are int64 already on the device, which megatron's `.to(scores.device)` leaves alone. Before:
    one blocking copy per router per forward (2 x 3 MoE layers per micro-batch with recomputation)."""
    for rank in runs:
        t = rank["tp2_sp"]["transfers"]
        assert t["routers"] == 3, t  # the tiny Qwen3-MoE's MoE layers (4 layers, layer 2 dense)
        assert t["copies"] == [True], t  # one copy, non_blocking
        assert t["targets"] == [("meta", torch.int64)] * 3, t


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
