"""vapo-plan sizes the Qwen3 configs: configs/qwen3_32b_vapo.yaml (dense) and
configs/qwen3_30b_a3b_vapo.yaml (mixture of experts at EP=2, each EP group in one node) fit on 8
nodes x 8 H100 80 GB; an invalid parallel.ep is refused in one line naming it; expert parallelism
divides the routed experts' parameters per GPU by EP, against an independent count from the
published config.json values (Qwen/Qwen3-30B-A3B: 48 layers, 128 experts of width 768, hidden 2048,
32 query / 4 KV heads of 128, vocab 151936, untied), written here without model_providers. vapo-plan
runs in a spawned process (it activates cpu_compat and a fake process group, which must not leak
into pytest).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers.dist_utils import run_ranks
from tests.helpers.plan_runs import plan_outputs

REPO = Path(__file__).resolve().parents[2]
DENSE = str(REPO / "configs" / "qwen3_32b_vapo.yaml")
MOE = str(REPO / "configs" / "qwen3_30b_a3b_vapo.yaml")
# Qwen/Qwen3-30B-A3B's config.json, the fields that set parameter shapes.
L, E, K, H, F_E, HEADS, KV, D, V = 48, 128, 8, 2048, 768, 32, 4, 128, 151936
EXPERTS = L * E * 3 * H * F_E  # gate, up and down projections of every routed expert


def naive_moe_count(*, critic: bool) -> int:
    """embedding + layers * (q, k, v, o without biases + q/k RMSNorms over head_dim + 2 RMSNorms +
    router [E, H] + E SwiGLU experts) + final norm + lm_head (actor) or a value head with bias."""
    attn = H * HEADS * D + 2 * H * KV * D + HEADS * D * H + 2 * D
    layer = attn + 2 * H + E * H + E * 3 * H * F_E
    return V * H + L * layer + H + (H + 1 if critic else V * H)


def test_vapo_plan_accepts_the_qwen3_configs_and_names_a_bad_ep():
    dense = ["--config", DENSE, "--preset", "qwen3-32b", "--nodes", "8", "--gpus-per-node", "8"]
    moe = ["--config", MOE, "--preset", "qwen3-30b-a3b", "--nodes", "8", "--gpus-per-node", "8"]
    (ok_dense, ok_moe, not_dp, not_experts, on_dense, no_sp), = run_ranks(1, plan_outputs, [
        dense, moe,
        moe + ["parallel.ep=32"],  # DP = 64 / 4 = 16
        ["--config", MOE, "--preset", "qwen3-30b-a3b", "--nodes", "6", "--gpus-per-node", "8",
         "parallel.ep=3"],  # DP = 48 / 4 = 12: 3 divides it, not the 128 experts
        dense + ["parallel.ep=2"],  # DP = 2
        moe + ["parallel.sequence_parallel=false"],
    ])
    for rc, out, err in (ok_dense, ok_moe):
        assert rc == 0, out + err
        # Quiet: megatron once warned "sequence parallelism must be used" for a MoE config that sets it
        # (vapo-plan built its shards without the config's parallel.sequence_parallel).
        assert err == "", err
        assert "fits: training peak" in out and "DOES NOT FIT" not in out
    assert "model: preset qwen3-32b" in ok_dense[1] and "TP=8 PP=4 VPP=- DP=2;" in ok_dense[1]
    assert "MoE" not in ok_dense[1] and "EP=" not in ok_dense[1]
    out = ok_moe[1]
    assert "model: preset qwen3-30b-a3b" in out
    assert "TP=4 PP=1 VPP=- DP=16 EP=2 (expert-DP=8; each EP group within one node);" in out
    assert "optimizer state (Adam, / DP=16, experts / 8)" in out
    for item in ("MoE router logits + probs [T/s, E] fp32", "MoE all-to-all dispatch [T*k, h]",
                 "MoE expert MLP [T*k, 3f_e/t]", "MoE all-to-all combine [T*k, h], transient"):
        assert out.count(f"    {item}") == 2, item  # under both activation rows
    # Every EP rank's experts in the model's count: the published model (padded vocabulary at TP=4:
    # 151936 -> a multiple of 512 = 152064, in embedding and output layer).
    padding = (152_064 - V) * H
    actor, critic = naive_moe_count(critic=False) + 2 * padding, naive_moe_count(critic=True) + padding
    assert f"actor {actor:,}, critic {critic:,}" in out
    assert 30.5e9 < naive_moe_count(critic=False) < 30.6e9  # the model card's 30.5B
    # Routing replay (on by default for MoE): the step's routes on each rank, at full length: 512
    # prompts x 16 samples / DP=16 sequences of 2048 + 20480 tokens x 48 layers x top-8, one byte each, twice.
    routes = 2 * (512 * 16 // 16) * 22528 * L * K
    assert "routing replay (rollout.routing_replay): host memory per rank, at most" in out
    (line,) = [x for x in out.splitlines()
               if f"host: the step's routes (512 sequences x 22,528 tokens x {L} MoE layers x {K})" in x]
    assert line.split()[-1] == f"{routes / 2**30:.2f}", line
    assert "routing replay ids [L, T/s, k], this stage" in out  # in the training reserve
    assert "routing replay" not in ok_dense[1]

    # An invalid parallel.ep: exit status 2, nothing built, one line naming parallel.ep.
    for (rc, out, err), says in ((not_dp, "parallel.ep=32 does not divide the data-parallel size 16"),
                                 (not_experts, "parallel.ep=3 does not divide the 128 experts of model.hf_path"),
                                 (on_dense, "parallel.ep=2 needs a mixture-of-experts model")):
        assert rc == 2 and out == "", out
        assert err.startswith("vapo-plan: invalid configuration for ") and err.count("\n") == 1, err
        assert says in err, err
    rc, out, err = no_sp
    assert rc == 2 and err.count("\n") == 1 and "set parallel.sequence_parallel=true" in err, err


def _ep1_and_ep8():
    from model_providers.presets import preset
    from vapo_megatron.sizing.shards import shard_sizes

    hf = preset("qwen3-30b-a3b")
    return [shard_sizes(hf, hf, world_size=64, tp=1, pp=1, vpp=None, params_dtype=torch.bfloat16, ep=ep)[0]
            for ep in (1, 8)]


def test_expert_parallelism_divides_the_expert_bytes_per_gpu():
    from vapo_megatron.sizing.memory import state_bytes

    (ep1, ep8), = run_ranks(1, _ep1_and_ep8)
    assert EXPERTS == 28_991_029_248
    # Megatron's shards (TP=1, PP=1): every expert on the one EP rank, then E/EP = 16 per layer.
    assert ep1.actor_expert == ep1.critic_expert == EXPERTS
    assert ep8.actor_expert == ep8.critic_expert == EXPERTS // 8
    for s in (ep1, ep8):  # the model's count does not depend on EP
        assert s.actor_unique == naive_moe_count(critic=False) and s.critic_unique == naive_moe_count(critic=True)
    dense = naive_moe_count(critic=False) - EXPERTS
    assert ep1.actor_params == dense + EXPERTS and ep8.actor_params == dense + EXPERTS // 8
    # Parameter bytes per GPU (bf16): the experts' share divided by EP, the rest unchanged.
    p1, g1, o1 = state_bytes(ep1.actor_params, dtype_bytes=2, dp=64, distributed_optimizer=True,
                             expert_params=ep1.actor_expert, ep=1)
    p8, g8, o8 = state_bytes(ep8.actor_params, dtype_bytes=2, dp=64, distributed_optimizer=True,
                             expert_params=ep8.actor_expert, ep=8)
    assert p1 - p8 == 2 * (EXPERTS - EXPERTS // 8) and p8 - 2 * dense == 2 * EXPERTS // 8
    assert g1 - g8 == 4 * (EXPERTS - EXPERTS // 8)  # one fp32 main_grad per parameter on the rank
    # The distributed optimizer: dense state over DP=64, the experts' over expert-DP = 64 / EP; per
    # GPU the same either way (all experts / 64 = an eighth of them / 8).
    assert o1 == math.ceil(12 * dense / 64) + math.ceil(12 * EXPERTS / 64)
    assert o8 == math.ceil(12 * dense / 64) + math.ceil(12 * (EXPERTS // 8) / 8) == o1


def test_moe_activation_items_follow_the_routed_tokens():
    """memory.moe_layer_parts written out for Qwen3-30B-A3B at T tokens, TP=4 with sequence
    parallelism: each token goes to its top-8 experts."""
    from model_providers.presets import preset
    from vapo_megatron.sizing.memory import (
        MOE_COMBINE,
        MOE_DISPATCH,
        MOE_EXPERT_MLP,
        MOE_ROUTER,
        layer_activation_bytes,
        moe_layer_parts,
    )

    hf, T, t, b = preset("qwen3-30b-a3b"), 22528, 4, 2
    parts = moe_layer_parts(hf, tokens=T, tp=t, dtype_bytes=b, sequence_parallel=True)
    assert parts == {MOE_ROUTER: 2 * 4 * (T // t) * E, MOE_DISPATCH: b * T * K * H,
                     MOE_EXPERT_MLP: b * T * K * 3 * F_E // t, MOE_COMBINE: b * T * K * H}
    # A layer keeps its attention items and the MoE ones but the transient combine; no dense MLP.
    attention = b * T * (4 * H // t + ((HEADS + 2 * KV) * D + HEADS * D) // t)
    kept = parts[MOE_ROUTER] + parts[MOE_DISPATCH] + parts[MOE_EXPERT_MLP]
    assert layer_activation_bytes(hf, tokens=T, tp=t, dtype_bytes=b, sequence_parallel=True) == attention + kept
    assert moe_layer_parts(preset("qwen3-32b"), tokens=T, tp=t, dtype_bytes=b) == {}


def test_routing_replay_bytes_of_qwen3_235b_a22b():
    """memory.route_parts written out for Qwen3-235B-A22B (94 MoE layers, top-8 of 128 experts: 752
    one-byte ids per token) at DP=8, TP=4 with sequence parallelism, PP=4, full recomputation."""
    from model_providers.presets import preset
    from vapo_megatron.config import load_config
    from vapo_megatron.sizing.memory import ROUTES_DEVICE_ITEM, route_parts

    hf = preset("qwen3-235b-a22b")
    assert (hf["num_hidden_layers"], hf["num_experts_per_tok"], hf["num_experts"]) == (94, 8, 128)
    cfg = load_config(MOE, ["parallel.pp=4", "rollout.prompts_per_step=256"], check_paths=False)
    parts = route_parts(cfg, hf, dp=8, inflight_microbatches=4)
    seqs, tokens, T = 256 * 16 // 8, 2048 + 20480, 22528 // 4
    stage = 24 * T * 8  # one micro-batch's ids of a stage's 24 MoE layers, one byte each
    # host: the step's routes twice, the pinned micro-batch; device: its copy, the int64 ids of the
    # 4 in-flight micro-batches (queued for the recomputed forward), one layer's float32 weights
    assert list(parts.values()) == [2 * seqs * tokens * 94 * 8, stage, stage + 4 * stage * 8 + T * 8 * 4]
    assert ROUTES_DEVICE_ITEM in parts
    off = load_config(MOE, ["rollout.routing_replay=false"], check_paths=False)
    assert route_parts(off, hf, dp=8, inflight_microbatches=1) == {}
    assert route_parts(cfg, preset("qwen3-32b"), dp=8, inflight_microbatches=1) == {}  # dense: nothing to replay


@pytest.mark.parametrize("tp,pp,dp,ep,gpn", [(4, 1, 16, 8, 8), (4, 1, 16, 2, 8), (2, 2, 16, 4, 8), (1, 1, 64, 16, 8),
                                             (8, 1, 8, 8, 8), (4, 2, 8, 4, 4), (2, 1, 32, 8, 16)])
def test_ep_group_span_follows_megatrons_rank_order(tp, pp, dp, ep, gpn):
    """vapo-plan's EP-group span against megatron's own expert rank generator (order tp-ep-dp-pp,
    parallel_state.initialize_model_parallel): the configs' EP=8 at TP=4 spanned 4 nodes (issue 32
    defect 9)."""
    from megatron.core.parallel_state import RankGenerator

    from vapo_megatron.sizing.report import ep_group_nodes

    groups = RankGenerator(tp=tp, ep=ep, dp=dp // ep, pp=pp, cp=1, order="tp-ep-dp-pp").get_ranks("ep")
    want = max(len({r // gpn for r in g}) for g in groups)
    assert ep_group_nodes(tp=tp, pp=pp, dp=dp, ep=ep, gpus_per_node=gpn) == want
    if (tp, ep, gpn) == (4, 8, 8):
        assert want == 4
