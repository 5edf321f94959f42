"""vapo-plan with critic.parallel (issue 65 items 6, 7): a critic at its own layout on the actor's GPUs
is sized at its own TP/PP/DP (a hand count of Qwen3-8B's shards, each GPU holding the actor's shard
of its actor position beside the critic's of its critic position) and timed there (the step-time
formulas by hand); critic.parallel equal to the actor's layout is the null critic's plan; a bad
critic layout is refused naming critic.parallel.*; --search finds a critic layout other than the
actor's, whose figures are vapo-plan's for that pair given as overrides. Qwen3-32B actor, 8 x 8 GPUs.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

from tests.distributed.test_plan import megatron_padded_vocab
from tests.distributed.test_plan_critic import qwen3_critic_count
from tests.helpers.dist_utils import run_ranks

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CONFIG, SMALL = str(CONFIGS / "qwen3_32b_vapo.yaml"), str(CONFIGS / "qwen3_32b_vapo_8b_critic.yaml")
ARGS = ["--nodes", "8", "--gpus-per-node", "8", "--preset", "qwen3-32b"]
CRITIC_TP2 = ("critic.parallel.tp=2", "critic.parallel.pp=2", "critic.parallel.sequence_parallel=true")
GIB = 2 ** 30


def _cli(*argv: str) -> tuple[int, str]:
    from vapo_megatron.plan import main

    o = io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(o):
        rc = main(list(argv))
    return rc, o.getvalue()


def _seconds(out: str, phase: str) -> float:
    return float(re.search(rf"^\s+{phase}\s+([0-9.]+)\s", out, re.M).group(1))


# ---- memory: the critic's shards at its own layout, by hand ---------------------------------------------

def replicated(c: dict, layers: int, last: bool) -> int:
    """A Qwen3 critic stage's TP-replicated parameters: per layer two RMSNorms and the q/k norms;
    on the last stage the final norm and the value head [1, h] + bias."""
    h, d = c["hidden_size"], c["head_dim"]
    return layers * (2 * h + 2 * d) + (2 * h + 1 if last else 0)


def critic_stage_count(c: dict, *, tp: int, pp: int, stage: int) -> int:
    """Parameters on one GPU of a Qwen3 critic at (tp, pp): its stage's layers (q, k, v, o and SwiGLU
    split over TP, the norms whole), the embedding (padded vocabulary / TP) on stage 0."""
    h, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv, layers = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["num_hidden_layers"] // pp
    sharded = layers * (2 * h * q + 2 * h * kv + 3 * h * f) // tp
    embedding = megatron_padded_vocab(c["vocab_size"], tp) * h // tp if stage == 0 else 0
    return sharded + embedding + replicated(c, layers, stage == pp - 1)


def _plans():
    from vapo_megatron.config.quiet import quiet_startup

    quiet_startup()
    from model_providers.presets import preset
    from vapo_megatron.config import parse_config
    from vapo_megatron.sizing.plan import make_plan

    actor, critic = ({**preset(n), "_source": f"preset {n}"} for n in ("qwen3-32b", "qwen3-8b"))

    def plan(*overrides: str) -> dict:
        p = make_plan(parse_config(CONFIG, list(overrides))[0], actor, critic, world_size=64, gpu_memory_gib=80.0)
        return {"layout": p.critic_layout, "checkpoint": p.checkpoint, "problems": p.problems,
                "actor_total": sum(s.actor_unique for s in p.shards),
                "ranks": [(m.tp_rank, m.pp_rank, m.critic_tp_rank, m.critic_pp_rank, m.parts, m.training, m.rollout,
                           m.reserve) for m in p.ranks]}
    return (plan(), plan("critic.parallel.tp=8", "critic.parallel.pp=4", "critic.parallel.sequence_parallel=true"),
            plan("critic.parallel.tp=1", "critic.parallel.pp=2"), plan(*CRITIC_TP2))


def test_the_critics_own_layout_is_its_shards_state_and_pairs_by_hand():
    from model_providers.presets import preset

    follow, same, tp1, tp2 = run_ranks(1, _plans)[0]
    # critic.parallel equal to the actor's layout: the plan of critic.parallel null, to the byte.
    assert same == follow and follow["layout"] is None

    c = preset("qwen3-8b")
    assert tp2["layout"] == (2, 2, 16, None, 1) and tp1["layout"] == (1, 2, 32, None, 1)
    actor_parts = {(tp, pp): {k: v for k, v in parts.items() if k.startswith("actor")}
                   for tp, pp, _, _, parts, _, _, _ in follow["ranks"]}
    for tp, pp, ctp, cpp, parts, training, rollout, reserve in tp2["ranks"]:
        # Each GPU, global rank g: actor (g % 8, g // 16), critic (g % 2, g // 32): the same g.
        assert ctp == tp % 2 and cpp == pp // 2, (tp, pp, ctp, cpp)
        n = critic_stage_count(c, tp=2, pp=2, stage=cpp)
        assert parts["critic count"] == n
        assert (parts["critic parameters"], parts["critic gradients"], parts["critic optimizer state"]) == (
            2 * n, 4 * n, math.ceil(12 * n / 16))  # bf16, fp32 main_grad, Adam / the critic's DP = 64 / 4
        assert {k: v for k, v in parts.items() if k.startswith("actor")} == actor_parts[(tp, pp)]  # unchanged
        # Both models' state on the GPU, the larger model's activations, the reserve with the critic's groups.
        state = sum(parts[f"{m} {k}"] for m in ("actor", "critic") for k in ("parameters", "gradients",
                                                                              "optimizer state"))
        acts = max(parts["actor activations"], parts["critic activations"])
        assert training == state + acts + sum(reserve["training"].values())
        assert reserve["training"]["NCCL buffers, the critic's own groups (3)"] == 3 * GIB // 4  # its TP, PP, DP
    assert {(pp, cpp) for _, pp, _, cpp, *_ in tp2["ranks"]} == {(0, 0), (1, 0), (2, 1), (3, 1)}
    # TP=2 holds half the TP-sharded weights of TP=1 per GPU (stage 1: no embedding, whose padding differs).
    n1, n2 = ({r[3]: r[4]["critic count"] for r in p["ranks"]}[1] for p in (tp1, tp2))
    repl = replicated(c, 18, last=True)
    assert n1 == critic_stage_count(c, tp=1, pp=2, stage=1) and n1 - repl == 2 * (n2 - repl)
    # A checkpoint: both models' distinct parameters, the critic's vocabulary padded at its own TP.
    assert tp2["checkpoint"] == 14 * (follow["actor_total"] + qwen3_critic_count(c, megatron_padded_vocab(
        c["vocab_size"], 2)))
    assert not tp2["problems"]


# ---- time: the critic's forward and update at its own PP, DP and shard, by hand -----------------------

def test_the_critics_own_layout_is_timed_at_its_pp_dp_and_shard():
    from model_providers.presets import preset
    from vapo_megatron.config import parse_config
    from vapo_megatron.sizing.flops import forward_flops_per_token, shapes_from_hf
    from vapo_megatron.sizing.hardware import GPUS
    from vapo_megatron.sizing.step_config import setup_from_config
    from vapo_megatron.sizing.step_time import estimate

    gpu = GPUS["h100"]
    actor, critic = ({**preset(n), "_source": n} for n in ("qwen3-32b", "qwen3-8b"))
    own_cfg = parse_config(CONFIG, ["critic.parallel.tp=8", "critic.parallel.pp=1"])[0]
    follow, own = (estimate(gpu, setup_from_config(cfg, actor, critic, world=64, gpus_per_node=8, gpu=gpu))
                   for cfg in (parse_config(CONFIG, [])[0], own_cfg))
    for phase in ("rollout", "actor_update", "sync", "checkpoint"):
        assert own.phases[phase].seconds == follow.phases[phase].seconds, phase

    s = shapes_from_hf(critic)
    tokens = 8192 * (200 + 5120)  # 512 prompts x 16 samples, mean prompt and response (the defaults)
    flops = tokens * 1.05 * forward_flops_per_token(s, context=5320 / 2, lm_head=False)  # padded
    forward = flops / (64 * gpu.bf16_flops * 0.40)
    network = gpu.network_bytes_s * 0.8  # a DP group of 64 / PP ranks spans the nodes

    def micro_batches(dp: int) -> int:  # per DP rank and mini-batch of 16
        return math.ceil(tokens / 16 / dp * 1.05 / 22528)

    # PP=4, DP=2 (the actor's): bubble 1 + 3 / m; PP=1, DP=8: none, 4x the shard in the gradient sync.
    follow_sync = 16 * 6 * s.params(critic=True) / 32 * (1 / 2) / network
    own_sync = 16 * 6 * s.params(critic=True) / 8 * (7 / 8) / network
    assert micro_batches(2) == 64 and micro_batches(8) == 16
    assert math.isclose(follow.critic_forward_s, forward * (1 + 3 / math.ceil(tokens / 2 * 1.05 / 22528)))
    assert math.isclose(own.critic_forward_s, forward)
    assert math.isclose(follow.phases["critic_update"].seconds, 4 * forward * (1 + 3 / 64) + follow_sync)
    assert math.isclose(own.phases["critic_update"].seconds, 4 * forward + own_sync)
    assert "at the critic's own layout TP=8 PP=1 DP=8" in own.phases["critic_update"].how


# ---- vapo-plan: the shipped 8B-critic config, refusals, and the search's critic layout ---------------------

def _runs():
    from vapo_megatron.config.quiet import quiet_startup

    quiet_startup()
    small = ["--config", SMALL, *ARGS, "--critic-preset", "qwen3-8b", "--gpu", "h100"]
    runs = {"shipped": _cli(*small), "follow": _cli(*small, "critic.parallel=null")}
    for name, extra in (("tp3", ["critic.parallel.tp=3"]), ("world", ["critic.parallel.tp=8", "critic.parallel.pp=16"]),
                        ("search", ["--search", "critic.parallel.tp=3"])):
        runs[name] = _cli(*small, *extra)
    seven = ["--config", CONFIG, *ARGS, "--critic-preset", "qwen2.5-7b"]
    runs["7b_own"] = _cli(*seven, "critic.parallel.tp=4", "critic.parallel.pp=1",
                          "critic.parallel.sequence_parallel=true")
    rc, text = _cli("--config", CONFIG, *ARGS, "--critic-preset", "qwen3-8b", "--gpu", "h100", "--search", "--json",
                    "--top", "1")
    best = json.loads(text)[0]
    pair = best["critic_layouts"][0]
    runs["pair"] = _cli("--config", CONFIG, *ARGS, "--critic-preset", "qwen3-8b", "--gpu", "h100",
                        *best["overrides"], *pair["overrides"])
    return runs, rc, best


def test_vapo_plan_sizes_refuses_and_searches_the_critics_own_layout():
    runs, rc, best = run_ranks(1, _runs)[0]
    (rc_own, own), (rc_follow, follow) = runs["shipped"], runs["follow"]
    assert rc_own == rc_follow == 0, own[-2000:] + follow[-2000:]
    assert "critic layout (critic.parallel): TP=8 PP=1 VPP=- DP=8" in own and "critic layout" not in follow
    assert _seconds(own, "actor_update") == _seconds(follow, "actor_update")
    assert _seconds(own, "critic_update") < _seconds(follow, "critic_update")
    assert "the critic at its own layout TP=8 PP=1 DP=8 (critic.parallel)" in own
    assert "modelled from its FLOPs at MFU 0.40 whatever its TP" in own

    # Refused, one line each naming critic.parallel.*, before any sizing (exit 2), also with --search.
    for name, says in (("tp3", "critic.parallel.tp=3 does not divide num_attention_heads=32 of model.critic_hf_path "
                                "(preset qwen3-8b)"),
                       ("world", "critic.parallel.tp * critic.parallel.pp = 8 * 16 = 128 does not divide the world "
                                 "size 64"),
                       ("search", "critic.parallel.tp=3 does not divide num_key_value_heads=8")):
        code, text = runs[name]
        assert code == 2 and says in text and "Traceback" not in text, (name, text)
    # Qwen2.5-7B's 28 heads do not split over the actor's TP=8 (test_plan_critic), but do at its own TP=4.
    code, text = runs["7b_own"]
    assert code == 0 and "critic layout (critic.parallel): TP=4 PP=1" in text, text[-2000:]

    # --search: the critic's fastest layout beside the fastest actor layout is not the actor's, and
    # vapo-plan given that pair as overrides prints the search's step.
    assert rc == 0 and best["rank"] == 1 and best["critic"] is None
    pair = best["critic_layouts"][0]
    assert pair["fits"] and pair["critic"] is not None
    assert (pair["critic"]["tp"], pair["critic"]["pp"]) != (best["tp"], best["pp"])
    assert pair["step_s"] <= min(r["step_s"] for r in best["critic_layouts"] if r["fits"])
    assert any(r["critic"] is None for r in best["critic_layouts"])  # the critic at the actor's layout, tried
    code, text = runs["pair"]
    assert code == 0 and abs(_seconds(text, "step") - pair["step_s"]) < 0.05, text[-2000:]
    assert f"critic layout (critic.parallel): TP={pair['critic']['tp']} PP={pair['critic']['pp']}" in text
