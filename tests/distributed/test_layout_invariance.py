"""The defining test of the parallel-aware form (docs/algorithm.md): after one optimizer step
on a fixed global mini-batch, actor (PPO + NLL) and critic (value loss) parameters are the
same for every layout, and equal a direct single-process implementation of the formulas.

Reference: transformers' own Qwen2 and Qwen3-MoE models (independent of Megatron), the loss
formulas written out directly, and a plain SGD step. The MoE model is also stepped at expert
parallelism 2, where each DP rank holds half the experts and tokens cross ranks by all-to-all.
SGD, not Adam: Adam's first step is nearly invariant to the gradient's scale, so it would hide
exactly the normalization errors this test is for.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from tests.helpers.dist_utils import run_ranks

LR = 0.5
MU = 0.1
EPS_LOW, EPS_HIGH = 0.2, 0.28
VALUE_CLIP = 0.5
TEMPERATURE = 0.7
VOCAB = 250  # needs padding at TP=2


def make_models(tmp_path, moe: bool = False):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config

    from tests.helpers.tiny_hf import qwen3_moe_config

    torch.manual_seed(0)
    if moe:  # 4 experts, top-2, layer 2 dense
        cfg = qwen3_moe_config(vocab=VOCAB)
    else:
        cfg = Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6,
        )
    actor = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # non-zero q/k/v biases, and every weight well away from init values
        for name, p in actor.named_parameters():
            p.add_(torch.randn_like(p) * 0.02)
    actor.save_pretrained(tmp_path / "actor")
    critic_cfg = type(cfg)(**{**cfg.to_dict(), "num_labels": 1})
    critic = AutoModelForTokenClassification.from_config(critic_cfg).float()
    critic.model.load_state_dict(actor.model.state_dict())
    with torch.no_grad():
        critic.score.weight.normal_(0, 0.1)
        if critic.score.bias is not None:
            critic.score.bias.fill_(0.3)
    critic.save_pretrained(tmp_path / "critic")
    return str(tmp_path / "actor"), str(tmp_path / "critic")


def global_batch(grpo: bool = False):
    """8 responses of very different lengths (1..21 tokens), 3 of them correct, in 4 groups of 2.
    grpo: the advantages are GRPO's group-relative ones of the whole batch (algo.estimator=grpo)."""
    from vapo_megatron.data.batch import RolloutBatch, pack_sequences, to_sequence

    g = torch.Generator().manual_seed(1)
    prompt_lens = [3, 5, 4, 6, 3, 7, 5, 4]
    resp_lens = [21, 1, 9, 2, 15, 4, 12, 6]
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in resp_lens]
    tokens, pl, rl = pack_sequences(prompts, responses)
    T = max(resp_lens)
    B = len(prompts)
    batch = RolloutBatch(
        tokens=tokens, prompt_lens=pl, response_lens=rl,
        rewards=torch.tensor([1.0, -1, -1, 1, -1, -1, 1, -1]),
        correct=torch.tensor([True, False, False, True, False, False, True, False]),
        group_ids=torch.arange(B) // 2,
    )
    S = tokens.shape[1]
    # Fixed inputs of the losses (what rollout, GAE and the pre-update passes produced).
    batch.advantages = to_sequence(torch.randn(B, T, generator=g), pl, rl, S)
    batch.returns = to_sequence(torch.randn(B, T, generator=g), pl, rl, S)
    batch.extras["old_logp_offset"] = to_sequence(0.3 * torch.randn(B, T, generator=g), pl, rl, S)
    batch.extras["old_value_offset"] = to_sequence(0.6 * torch.randn(B, T, generator=g), pl, rl, S)
    if grpo:
        batch.advantages = _grpo_advantages(batch)
    return batch


def _grpo_advantages(batch):
    from vapo_megatron.config import AlgoConfig
    from vapo_megatron.config.estimators import ESTIMATORS

    return ESTIMATORS["grpo"].function()(batch, AlgoConfig(estimator="grpo"), value_pretrain=False,
                                         dp_sum=lambda t: t)[0]


# ---- reference: transformers + the formulas, single process ---------------------------------

def _reference(actor_dir, critic_dir, loss_agg="token", grpo=False):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from vapo_megatron.data.batch import shifted_targets

    b = global_batch(grpo)
    mask = b.mask
    N, N_pos, M = mask.sum(), (mask * b.correct[:, None]).sum(), b.size

    actor = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32)
    logits = actor(b.tokens).logits.float() / TEMPERATURE
    logp = torch.log_softmax(logits, -1).gather(-1, shifted_targets(b.tokens)[..., None])[..., 0]
    old_logp = logp.detach() + b.extras["old_logp_offset"]
    ratio = torch.exp(logp - old_logp)
    A = b.advantages
    term = -torch.minimum(ratio * A, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * A)
    if loss_agg == "token":
        l_ppo = (term * mask).sum() / N
    else:
        l_ppo = ((term * mask).sum(1) / mask.sum(1)).sum() / M
    l_nll = -(logp * mask * b.correct[:, None]).sum() / N_pos
    (l_ppo + MU * l_nll).backward()
    with torch.no_grad():
        for p in actor.parameters():
            p -= LR * p.grad
    actor_after = per_expert(actor.state_dict())

    critic = AutoModelForTokenClassification.from_pretrained(critic_dir, dtype=torch.float32)
    values = critic(b.tokens).logits[..., 0]
    old_values = values.detach() + b.extras["old_value_offset"]
    clipped = old_values + torch.clamp(values - old_values, -VALUE_CLIP, VALUE_CLIP)
    G = b.returns
    l_v = (0.5 * torch.maximum((values - G) ** 2, (clipped - G) ** 2) * mask).sum() / N
    l_v.backward()
    with torch.no_grad():
        for p in critic.parameters():
            p -= LR * p.grad
    critic_after = per_expert(critic.state_dict())
    return actor_after, critic_after


def per_expert(state: dict) -> dict:
    """transformers 5's fused expert tensors as the per-expert HF names the export writes."""
    from vapo_megatron.rollout.embedded import expert_views

    views = expert_views(state)
    fused = [k for k in state if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    return {k: v.detach().clone() for k, v in {**state, **views}.items() if k not in fused}


# ---- the parallel code under test ------------------------------------------------------------

def _dp_split(dp_rank: int, dp_size: int, grpo: bool = False) -> list[int]:
    # Uneven on purpose: rank 0 gets 3 responses (27 tokens), rank 1 gets 5 (38 tokens). GRPO's
    # groups stay whole on one rank, as the trainer deals them: rank 0 gets group 0 (22 tokens).
    if dp_size == 1:
        return list(range(8))
    return ([0, 1], [2, 3, 4, 5, 6, 7])[dp_rank] if grpo else ([0, 1, 2], [3, 4, 5, 6, 7])[dp_rank]


def _micro_split(rows: list[int], n_micro: int) -> list[list[int]]:
    return [list(c) for c in torch.tensor_split(torch.tensor(rows), n_micro) if len(c)]


def _parallel_step(actor_dir, critic_dir, tp, pp, n_micro, loss_agg, sp=False, ep=1, grpo=False):
    from megatron.core import dist_checkpointing  # noqa: F401  (import order: megatron first)

    import model_providers
    from vapo_megatron.config import OptimConfig
    from vapo_megatron.mcore import actor as actor_mod
    from vapo_megatron.mcore import critic as critic_mod
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.model import wrap_ddp
    from vapo_megatron.mcore.models import build_actor, build_critic
    from vapo_megatron.mcore.optimizer import build_optimizer, optimizer_step
    from vapo_megatron.mcore.schedule import broadcast_from_last_stage, forward_backward
    from vapo_megatron.mcore.update import global_counts
    from vapo_megatron.weights.hf_read import load_hf_weights
    from vapo_megatron.weights.params import iter_hf_tensors

    parallel.init_distributed(tp, pp, ep=ep, seed=7)
    b = global_batch()
    b = b.select(_dp_split(parallel.dp_rank(), parallel.dp_size(), grpo))
    if grpo:  # each rank estimates its own groups, as the trainer's step 5 does
        b.advantages = _grpo_advantages(b)
    counts = global_counts(b)
    optim = OptimConfig(lr=LR, clip_grad=0.0)

    results = {}
    for role, hf_dir in (("actor", actor_dir),) + ((("critic", critic_dir),) if not grpo else ()):
        is_critic = role == "critic"
        hf_cfg = model_providers.read_hf_config(hf_dir)
        family = model_providers.family_for(hf_cfg)
        build = build_critic if is_critic else build_actor
        chunks = [build(hf_cfg, params_dtype=torch.float32, sequence_parallel=sp)]
        assert chunks[0].config.sequence_parallel == sp
        load_hf_weights(chunks, family, hf_cfg, hf_dir, critic=is_critic)
        chunks = wrap_ddp(chunks, distributed_optimizer=False)
        opt = build_optimizer(chunks, optim, params_dtype=torch.float32, kind="sgd")
        micro = [b.select(r) for r in _micro_split(list(range(b.size)), n_micro)]
        if is_critic:
            with torch.no_grad():
                outs = forward_backward(chunks, critic_mod.value_outputs, micro, forward_only=True)
            full = torch.zeros_like(b.advantages)
            if parallel.is_last_stage():
                for rows, out in zip(_micro_split(list(range(b.size)), n_micro), outs):
                    full[rows, : out["values"].shape[1]] = out["values"]
            broadcast_from_last_stage([full])
            b.values = full + b.extras["old_value_offset"] * b.mask
            micro = [b.select(r) for r in _micro_split(list(range(b.size)), n_micro)]
            forward_backward(chunks, partial(critic_mod.value_loss, clip_range=VALUE_CLIP), micro, forward_only=False)
        else:
            with torch.no_grad():
                outs = forward_backward(chunks, partial(actor_mod.logprob_outputs, temperature=TEMPERATURE,
                                                        vocab_size=VOCAB, chunk_tokens=7), micro, forward_only=True)
            full = torch.zeros_like(b.advantages)
            if parallel.is_last_stage():
                for rows, out in zip(_micro_split(list(range(b.size)), n_micro), outs):
                    full[rows, : out["logp"].shape[1]] = out["logp"]
            broadcast_from_last_stage([full])
            b.old_logp = (full + b.extras["old_logp_offset"]) * b.mask
            micro = [b.select(r) for r in _micro_split(list(range(b.size)), n_micro)]
            settings = actor_mod.PolicyLossSettings(
                eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip_c=None, loss_agg=loss_agg,
                nll_coef=MU, temperature=TEMPERATURE, chunk_tokens=7,
            )
            forward_backward(chunks, partial(actor_mod.policy_loss, settings=settings, counts=counts, vocab_size=VOCAB),
                             micro, forward_only=False)
        applied, _ = optimizer_step(opt, chunks, loss_finite=True)
        assert applied
        results[role] = {k: v.clone()
                         for k, v in iter_hf_tensors([c.module for c in chunks], family, hf_cfg, critic=is_critic)}
    return results


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("layout")
    actor_dir, critic_dir = make_models(path)
    return actor_dir, critic_dir, {"token": _reference(actor_dir, critic_dir, "token")}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    path = tmp_path_factory.mktemp("layout-moe")
    actor_dir, critic_dir = make_models(path, moe=True)
    return actor_dir, critic_dir, {"token": _reference(actor_dir, critic_dir, "token")}


def _check(models, world, tp, pp, n_micro, loss_agg="token", sp=False, ep=1, grpo=False):
    actor_dir, critic_dir, refs = models
    key = (loss_agg, grpo) if grpo else loss_agg
    if key not in refs:
        refs[key] = _reference(actor_dir, critic_dir, loss_agg, grpo)
    ref_actor, ref_critic = refs[key]
    per_rank = run_ranks(world, _parallel_step, actor_dir, critic_dir, tp, pp, n_micro, loss_agg, sp, ep, grpo)
    for role, ref in (("actor", ref_actor),) + ((("critic", ref_critic),) if not grpo else ()):
        got = {}
        for r in per_rank:
            got.update(r[role])
        assert set(got) == set(ref), f"{role}: names differ: {set(got) ^ set(ref)}"
        initial = _initial(actor_dir if role == "actor" else critic_dir)
        for name, want in ref.items():
            have = got[name]
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{role} {name}: {m}")
            # The update itself (not just the parameter) must match: catches scale errors.
            d_have, d_want = have - initial[name], want - initial[name]
            err = (d_have - d_want).norm() / d_want.norm().clamp(min=1e-12)
            assert err < 1e-3, f"{role} {name}: update differs by {err:.2e} relative"


def _initial(hf_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(hf_dir, "model.safetensors"))


LAYOUTS = {
    "dp2": (2, 1, 1, 1),
    "tp2": (2, 2, 1, 1),
    "pp2": (2, 1, 2, 2),
    "tp2xpp2": (4, 2, 2, 2),
    "dp2_3micro": (2, 1, 1, 3),
    # Sequence parallelism (megatron's, along T over the TP group). 3 micro-batches: widths 24,
    # 18 and 17, so one micro-batch is padded to a multiple of TP (mcore/schedule.py, forward_step).
    "tp2_sp_3micro": (2, 2, 1, 3, True),
    "tp2xpp2_sp": (4, 2, 2, 2, True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_step_matches_reference(models, layout):
    world, tp, pp, n_micro, *sp = LAYOUTS[layout]
    _check(models, world, tp, pp, n_micro, sp=sp == [True])


# Qwen3-MoE: (world, tp, pp, micro-batches, ep); sequence parallelism at TP=2 (megatron's MoE
# layer trains at TP > 1 only with it).
MOE_LAYOUTS = {"dp2_ep1": (2, 1, 1, 2, 1), "dp2_ep2": (2, 1, 1, 2, 2), "tp2_sp": (2, 2, 1, 2, 1)}


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_one_step_matches_reference(moe_models, layout):
    world, tp, pp, n_micro, ep = MOE_LAYOUTS[layout]
    _check(moe_models, world, tp, pp, n_micro, sp=tp > 1, ep=ep)


def test_sample_level_loss_matches_reference(models):
    _check(models, 2, 1, 1, 2, loss_agg="sample")


# GRPO (algo.estimator=grpo): advantages estimated per rank on whole groups; the actor's update
# equals the single-process reference whose advantages came from the whole batch. GRPO's
# per-response loss at DP x micro-batches, DAPO's token-level loss at TP x PP.
@pytest.mark.parametrize("layout", [("dp2_3micro", "sample"), ("tp2xpp2", "token")])
def test_grpo_actor_step_matches_reference(models, layout):
    name, loss_agg = layout
    world, tp, pp, n_micro = LAYOUTS[name]
    _check(models, world, tp, pp, n_micro, loss_agg=loss_agg, grpo=True)


def _repeat_step_grads(critic_dir):
    """Two updates with lr 0 on the same batch through the trainer's own optimizer_step: the
    second gradient must equal the first (Megatron's optimizer leaves param.grad aliased to
    main_grad; without clearing it, the next backward counts the first micro-batch twice)."""
    import model_providers
    from vapo_megatron.config import OptimConfig
    from vapo_megatron.mcore import critic as critic_mod
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.model import wrap_ddp
    from vapo_megatron.mcore.models import build_critic
    from vapo_megatron.mcore.optimizer import build_optimizer, optimizer_step
    from vapo_megatron.mcore.schedule import forward_backward
    from vapo_megatron.weights.hf_read import load_hf_weights

    parallel.init_distributed(1, 1, seed=7)
    b = global_batch()
    hf_cfg = model_providers.read_hf_config(critic_dir)
    chunks = [build_critic(hf_cfg, params_dtype=torch.float32)]
    load_hf_weights(chunks, model_providers.family_for(hf_cfg), hf_cfg, critic_dir, critic=True)
    chunks = wrap_ddp(chunks, distributed_optimizer=False)
    opt = build_optimizer(chunks, OptimConfig(lr=0.0, clip_grad=1e9), params_dtype=torch.float32, kind="adam")
    b.values = b.returns + 0.1 * b.mask
    micro = [b.select(r) for r in _micro_split(list(range(b.size)), 2)]
    grads = []
    for _ in range(2):
        forward_backward(chunks, partial(critic_mod.value_loss, clip_range=None), micro, forward_only=False)
        grads.append({n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()})
        assert optimizer_step(opt, chunks, loss_finite=True)[0]
    return grads


def test_repeated_update_sees_the_same_gradient(models):
    _, critic_dir, _ = models
    first, second = run_ranks(1, _repeat_step_grads, critic_dir)[0]
    assert first.keys() == second.keys()
    for name in first:
        assert first[name].abs().sum() > 0, name
        torch.testing.assert_close(second[name], first[name], rtol=1e-6, atol=0, msg=lambda m: f"{name}: {m}")
