"""vapo-plan: the 32B config fits on 8 x 8 H100 80 GB and is refused on one node, with a message
naming what does not fit; the meta-device shards it sizes have the right parameter counts.

References: Qwen2.5-32B's parameter count from its published config.json values by a naive
formula (written here, independent of model_providers), and the parameters of a real TP=2 model
built on two gloo ranks. Each vapo-plan run happens in a spawned process (tests/dist_utils): it
initializes torch.distributed with the fake backend and activates cpu_compat, which must not leak
into the pytest process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.helpers.dist_utils import run_ranks
from tests.helpers.plan_runs import plan_outputs

REPO = Path(__file__).resolve().parents[2]
CONFIG_32B = str(REPO / "configs" / "qwen2.5_32b_vapo.yaml")

# Qwen/Qwen2.5-32B's config.json: the fields that set parameter shapes as published (hidden 5120,
# 64 layers, 40 query / 8 KV heads, FFN 27648, vocab 152064, untied); the others do not change shapes.
QWEN25_32B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
    "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
    "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False,
    "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "attention_dropout": 0.0, "initializer_range": 0.02, "use_sliding_window": False,
}


def naive_count(c: dict, *, vocab: int, critic: bool) -> int:
    """embedding + layers * (attention with q/k/v biases + SwiGLU MLP + 2 RMSNorms) + final norm +
    lm_head (actor) or a 1-output value head with bias (critic)."""
    h, f, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    attn = (h * h + h) + 2 * (h * kv + kv) + h * h  # q, k, v (with biases), o (no bias)
    mlp = 3 * h * f  # gate, up, down
    layer = attn + mlp + 2 * h
    head = (h + 1) if critic else vocab * h
    return vocab * h + L * layer + h + head


def megatron_padded_vocab(vocab: int, tp: int) -> int:
    # Megatron pads the vocabulary to a multiple of 128 * TP (make_vocab_size_divisible_by=128).
    return math.ceil(vocab / (128 * tp)) * 128 * tp


# ---- CLI runs (in one spawned process) -------------------------------------------------------------

def _shards(hf_cfg: dict, world: int, tp: int, pp: int, vpp):
    from vapo_megatron.sizing.shards import shard_sizes

    return shard_sizes(hf_cfg, hf_cfg, world_size=world, tp=tp, pp=pp, vpp=vpp, params_dtype=torch.bfloat16)


def _cli_and_shards(tiny_dir: str):
    base = ["--config", CONFIG_32B, "--preset", "qwen2.5-32b"]
    runs = plan_outputs([
        base + ["--nodes", "8", "--gpus-per-node", "8", "--gpu", "h100"],
        base + ["--nodes", "1", "--gpus-per-node", "8"],
        base + ["--nodes", "1", "--gpus-per-node", "8", "parallel.pp=1"],
        ["--config", CONFIG_32B, "--nodes", "8", "--gpus-per-node", "8"],  # no --preset, no model files
        base + ["--nodes", "8", "--gpus-per-node", "8", "rollout.sglang.mem_fraction=0.75",
                "trainer.offload_during_rollout=false"],
        # The CPU demo config, its model read from model.hf_path/config.json (embedded engine).
        ["--config", str(REPO / "configs" / "demo_cpu.yaml"), "--nodes", "1", "--gpus-per-node", "2",
         "--gpu-memory-gib", "8", "--reserve-gib", "1", f"model.hf_path={tiny_dir}"],
        # Bad step-time options: refused before anything is built, one line each.
        base + ["--nodes", "8", "--gpus-per-node", "8", "--gpu", "x100"],
        base + ["--nodes", "8", "--gpus-per-node", "8", "--gpu", "h100", "--mean-response-tokens", "30000"],
    ])
    return runs, _shards(QWEN25_32B, 64, 8, 4, None)


def test_vapo_plan_32b(tmp_path):
    from model_providers.presets import preset

    (tmp_path / "config.json").write_text(json.dumps(preset("tiny-qwen2")))
    ((runs, shards),) = run_ranks(1, _cli_and_shards, str(tmp_path))
    (rc8, out8, err8), (rc1, out1, err1), (rc_pp1, out_pp1, _), (rc_nomodel, _, err_nomodel), (rc_kv, out_kv, _), \
        (rc_tiny, out_tiny, err_tiny), (rc_gpu, out_gpu, err_gpu), (rc_mean, out_mean, err_mean) = runs

    # 8 nodes x 8 GPUs: fits, and says so with both phases' peaks.
    assert rc8 == 0, out8 + err8
    assert "TP=8 PP=4 VPP=- DP=2" in out8
    assert "sequence parallel: on" in out8  # the 32B config's default
    assert "fits: training peak" in out8 and "DOES NOT FIT" not in out8
    assert "32 distinct (tp_rank, pp_rank) positions" in out8

    # --gpu h100: the step-time table beside the memory table, every phase of a VAPO step (the model's
    # figures are checked against published ones in tests/unit/test_step_time.py), step time, tokens/s/GPU
    # and the run's GPU-hours.
    table = out8[out8.index("step time on 64 x H100 SXM 80GB (--gpu)"):]
    assert "nothing here ran on a GPU" in table
    rows = {line.split()[0]: float(line.split()[1]) for line in table.splitlines()[3:]
            if line.startswith("  ") and line.split()[0] in ("offload", "rollout", "onload", "score", "critic_update",
                                                              "actor_update", "sync", "checkpoint", "step")}
    assert list(rows) == ["offload", "rollout", "onload", "score", "critic_update", "actor_update", "sync",
                          "checkpoint", "step"], table
    assert abs(sum(v for k, v in rows.items() if k != "step") - rows["step"]) < 0.5
    assert "mean 5,120 tokens (the default of --mean-response-tokens: rollout.max_new_tokens / 4)" in table
    assert "tokens/s/GPU: " in table and "GPU-hours on 64 GPUs" in table and "33 evaluations" in table
    for rc, out, err, option in ((rc_gpu, out_gpu, err_gpu, "--gpu=x100 is not a GPU this model knows"),
                                 (rc_mean, out_mean, err_mean, "--mean-response-tokens=30000 is more than "
                                                                "rollout.max_new_tokens=20480")):
        assert rc == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith("vapo-plan: invalid configuration for 8 x 8 GPUs: " + option), err

    # The same config on one node: TP*PP=32 cannot be laid out on 8 GPUs.
    assert rc1 == 2 and out1 == ""
    assert "parallel.tp * parallel.pp = 8 * 4 = 32 does not divide the world size 8" in err1

    # One node with a layout that is valid there (PP=1): refused for memory, naming phase, rank,
    # amount over and the largest component (Adam state of 4.1B parameters per GPU, DP=1).
    assert rc_pp1 == 1
    assert "DOES NOT FIT" in out_pp1
    assert "training does not fit on rank tp=0 pp=0: needs" in out_pp1
    assert "GiB over); largest parts: actor optimizer state" in out_pp1
    assert "rollout does not fit" not in out_pp1  # the state is in host memory during rollout (offload on)

    # 8 x 8, but the engine's share leaves too little beside the resident actor and critic state
    # (24 GiB per GPU) during rollout; training alone still fits.
    assert rc_kv == 1
    assert "rollout does not fit on rank" in out_kv and "training does not fit" not in out_kv
    assert "SGLang engine (rollout.sglang.mem_fraction x GPU) 60.0 GiB" in out_kv
    assert ("rollout: trainer.offload_during_rollout=true would move the trainer's 24.0 GiB per GPU "
            "to host memory" in out_kv)

    # The config as shipped offloads the trainer's state during rollout, and its engine share uses
    # what that frees: a KV cache at least 1.5x the one with the state resident (same rollout
    # peak), said to be computed, not measured.
    assert ("SGLang KV cache per GPU with and without trainer.offload_during_rollout (this config: on), computed "
            "from shapes and the estimates above, not measured, at this config's rollout peak of") in out8
    kv = {}
    for way in ("offloaded", "resident"):
        (line,) = [x for x in out8.splitlines() if x.startswith(f"  trainer state {way}:")]
        kv[way] = float(line.split("KV cache")[1].split("GiB")[0])
        kv[way + " sequences"] = int(line.split("tokens per engine, ")[1].split(" full sequences")[0])
        assert line.endswith("<- rollout.sglang.mem_fraction") == (way == "offloaded"), line
    assert "rollout.sglang.mem_fraction 0.85 =  68.0 GiB, KV cache  60.4 GiB" in out8
    assert kv["offloaded"] >= 1.5 * kv["resident"] and kv["resident"] == 36.4, kv
    assert kv["offloaded sequences"] == 87 and kv["resident sequences"] == 52, kv
    assert "off the GPU before the resume (trainer.offload_during_rollout; to pinned host memory, but the gradient " \
        "buffers: freed, zeroed on return), not counted:" in out8
    # Of the 24 GiB of state per GPU (bf16 weights 2 + fp32 main_grad 4 + Adam / DP=2 6, per model),
    # the gradient buffers' 8 are freed without a copy (issue 32 defect 5): 16 GiB pinned per GPU.
    assert "frees 24.0 GiB per GPU (worst rank), of which 16.0 GiB in pinned host memory" in out8
    assert "up to 127.9 GiB per node of 8 GPUs" in out8

    # The reserve, itemised per phase (worst rank): 5 NCCL communicators = world, TP, PP, DP and the
    # engine's TP group; the allocator's share follows the activations (2.33 GiB with recompute and
    # sequence parallelism).
    assert "NCCL buffers (5 communicators)" in out8 and "CUDA context, engine" in out8
    assert "allocator cache (0.25 x activations)                  0.58" in out8
    # One checkpoint: every parameter of both models once, bf16 weights + fp32 master copy + Adam's
    # two fp32 moments (2 + 4 + 4 + 4 bytes); 2 kept + the next one being written.
    vocab8 = megatron_padded_vocab(QWEN25_32B["vocab_size"], 8)
    ckpt = (naive_count(QWEN25_32B, vocab=vocab8, critic=False)
            + naive_count(QWEN25_32B, vocab=vocab8, critic=True)) * 14
    assert 0.9e12 < ckpt < 0.91e12
    assert (f"checkpoints: {ckpt / 1e9:,.1f} GB per save" in out8
            and f"{3 * ckpt / 1e12:,.2f} TB of disk at peak" in out8)

    # Without the model files and without --preset: a clear error, not a guess.
    assert rc_nomodel == 2 and "model.hf_path=/path/to/Qwen2.5-32B has no config.json" in err_nomodel
    assert "--preset NAME" in err_nomodel

    # A model directory's config.json is read when there is no --preset; no SGLang to size.
    assert rc_tiny == 0, out_tiny + err_tiny
    assert f"model: {tmp_path / 'config.json'}" in out_tiny
    assert "TP=2 PP=1 VPP=- DP=1; params float32" in out_tiny
    assert "rollout.engine=embedded: no colocated engine on these GPUs" in out_tiny
    assert "reserve per GPU, GiB, worst rank (--reserve-gib)" in out_tiny  # the flat figure replaces the items

    # Parameter counts of megatron's own shards against the naive formula (padded vocabulary).
    vocab = megatron_padded_vocab(QWEN25_32B["vocab_size"], 8)
    assert vocab == 152576
    assert {(s.tp_rank, s.pp_rank) for s in shards} == {(t, p) for t in range(8) for p in range(4)}
    assert sum(s.actor_unique for s in shards) == naive_count(QWEN25_32B, vocab=vocab, critic=False)
    assert sum(s.critic_unique for s in shards) == naive_count(QWEN25_32B, vocab=vocab, critic=True)
    # Unpadded: the published size, ~32.8B with embeddings.
    assert 32.7e9 < naive_count(QWEN25_32B, vocab=152064, critic=False) < 32.8e9
    # Activations are held for pp - pp_rank micro-batches under 1F1B (megatron's schedule, asked by
    # vapo-plan; the textbook count here).
    assert all(s.inflight_microbatches == 4 - s.pp_rank for s in shards)
    # Per-rank memory counts: TP-replicated tensors (2 RMSNorms per layer, final norm, value head)
    # sit on every TP rank.
    h, per_stage = 5120, 16
    for s in shards:
        replicated_actor = per_stage * 2 * h + (h if s.pp_rank == 3 else 0)
        replicated_critic = replicated_actor + (h + 1 if s.pp_rank == 3 else 0)
        sharded_actor = s.actor_unique - (replicated_actor if s.tp_rank == 0 else 0)
        sharded_critic = s.critic_unique - (replicated_critic if s.tp_rank == 0 else 0)
        assert s.actor_params == sharded_actor + replicated_actor
        assert s.critic_params == sharded_critic + replicated_critic


# ---- the meta-device shards against a real TP=2 model -----------------------------------------------

def _real_tp2_counts():
    from model_providers.presets import preset
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks

    parallel.init_distributed(tp=2, pp=1)
    hf = preset("tiny-qwen2")
    counts = {}
    for critic in (False, True):
        chunks = build_chunks(hf, params_dtype=torch.float32, critic=critic)
        counts[critic] = {name: tuple(p.shape) for c in chunks for name, p in c.named_parameters()}
        assert all(p.device.type == "cpu" for c in chunks for p in c.parameters())
    return parallel.tp_rank(), parallel.pp_rank(), counts


def _meta_tp2_counts():
    from model_providers.presets import preset

    return _shards(preset("tiny-qwen2"), 2, 2, 1, None)


def test_meta_shards_match_a_real_tp2_model():
    real = run_ranks(2, _real_tp2_counts)
    (meta,) = run_ranks(1, _meta_tp2_counts)
    by_pos = {(s.tp_rank, s.pp_rank): s for s in meta}
    assert set(by_pos) == {(0, 0), (1, 0)}
    for tp_rank, pp_rank, shapes in real:
        s = by_pos[(tp_rank, pp_rank)]
        assert s.actor_params == sum(math.prod(x) for x in shapes[False].values())
        assert s.critic_params == sum(math.prod(x) for x in shapes[True].values())


def test_sequence_parallel_splits_the_replicated_activations_over_tp():
    """The activation formula of docs/slurm.md written out: sequence parallelism divides the four
    replicated [T, h] tensors of a layer, and the input each layer keeps under full recompute, by TP."""
    from vapo_megatron.sizing.memory import activation_bytes, layer_activation_bytes

    hf = QWEN25_32B
    h, f, a, g = hf["hidden_size"], hf["intermediate_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    d, T, t, b = h // a, 22528, 8, 2
    sharded = ((a + 2 * g) * d + a * d + 3 * f) // t
    for sp, replicated in ((False, 4 * h), (True, 4 * h // t)):
        layer = b * T * (replicated + sharded)
        assert layer_activation_bytes(hf, tokens=T, tp=t, dtype_bytes=b, sequence_parallel=sp) == layer
        kept = b * T * h // (t if sp else 1)
        common = dict(tokens=T, tp=t, pp=4, vpp=None, inflight_microbatches=4, dtype_bytes=b, logits_vocab=0,
                      chunk_tokens=1024, sequence_parallel=sp)
        assert activation_bytes(hf, recompute=True, **common) == 4 * 16 * kept + layer
        assert activation_bytes(hf, recompute=False, **common) == 4 * 16 * layer


def test_reserve_items_follow_the_phase_and_the_layout():
    from vapo_megatron.config import parse_config
    from vapo_megatron.sizing.memory import GIB, SGLANG_STASH_ITEM, reserve_parts, sglang_stash_bytes

    cfg = parse_config(CONFIG_32B, [])[0]
    train = reserve_parts(cfg, world_size=64, dp=2, activations=int(16 * GIB), phase="training")
    roll = reserve_parts(cfg, world_size=64, dp=2, activations=int(16 * GIB), phase="rollout")
    assert train["allocator cache (0.25 x activations)"] == int(4 * GIB)
    assert "SGLang buffers outside its static share" in roll and "SGLang buffers outside its static share" not in train
    assert train["NCCL buffers (5 communicators)"] == roll["NCCL buffers (5 communicators)"]
    # SGLang's clones of its model buffers, kept on the GPU while its weights are released: held in
    # training only (resuming the weights drops them), sized as Qwen2.5-32B's RoPE cache.
    stash = reserve_parts(cfg, world_size=64, dp=2, activations=0, phase="training",
                          engine_stash=sglang_stash_bytes(QWEN25_32B))
    assert stash[SGLANG_STASH_ITEM] == QWEN25_32B["max_position_embeddings"] * 128 * 4  # [positions, head_dim] fp32
    assert SGLANG_STASH_ITEM not in roll
    # No colocated engine, one GPU: only the trainer's context and the allocator remain.
    solo = reserve_parts(parse_config(CONFIG_32B, ["rollout.engine=embedded", "parallel.tp=1", "parallel.pp=1"])[0],
                         world_size=1, dp=1, activations=0, phase="rollout")
    assert set(solo) == {"CUDA context, trainer", "NCCL buffers (0 communicators)",
                         "allocator: blocks pinned by live small tensors"}


# ---- the rollout phase at KV resume, by name ---------------------------------------------------------

def _plans_at_two_bucket_sizes():
    from vapo_megatron.config import parse_config
    from vapo_megatron.sizing.plan import make_plan
    from vapo_megatron.sizing.report import format_plan

    out = []
    for mb in (1024, 4096):
        cfg = parse_config(CONFIG_32B, [f"rollout.weight_sync_bucket_mb={mb}", "trainer.offload_during_rollout=false",
                                        "rollout.sglang.mem_fraction=0.55"])[0]
        plan = make_plan(cfg, QWEN25_32B, QWEN25_32B, world_size=64, gpu_memory_gib=80.0)
        out.append((plan, format_plan(plan, cfg, model_source="test", nodes=8, gpus_per_node=8)))
    return out


def test_rollout_names_what_remains_when_the_kv_cache_resumes():
    from vapo_megatron.sizing.memory import GIB, SGLANG_RUNTIME_ITEM

    ((small, text), (big, _)) = run_ranks(1, _plans_at_two_bucket_sizes)[0]
    state = [f"{m} {k}" for m in ("actor", "critic")
             for k in ("parameters", "gradient buffers (fp32 main_grad)", "optimizer state")]
    for m in small.ranks:
        # The named parts are the whole rollout figure besides the engine: nothing is a lump.
        runtime = m.reserve["rollout"][SGLANG_RUNTIME_ITEM]
        assert sum(m.kv_resume.values()) + small.engine_share + runtime == m.rollout
        assert list(m.kv_resume)[:6] == state
        assert {"CUDA context, trainer", "CUDA context, engine", "NCCL buffers (5 communicators)",
                "allocator: blocks pinned by live small tensors"} == set(m.kv_resume) - set(state)
        # Every rank frees the sync's transients before the owner resumes: none is counted.
        assert not [k for k in m.kv_resume if any(w in k.lower() for w in ("bucket", "gather", "embedding"))]
    # A bucket 4x larger changes nothing the GPU holds at KV resume; it is named as freed.
    assert [m.rollout for m in big.ranks] == [m.rollout for m in small.ranks]
    assert [m.kv_resume for m in big.ranks] == [m.kv_resume for m in small.ranks]
    assert big.freed_before_resume["weight-sync bucket (rollout.weight_sync_bucket_mb=4096)"] == 4 << 30
    gathered = small.freed_before_resume["gathered embedding/output layer (the sync's largest full tensor)"]
    assert gathered == megatron_padded_vocab(152064, 8) * 5120 * 2  # [padded vocab, h] in bf16, ~1.5 GB
    # The report lists the parts with their sizes, says they are computed, and sums them.
    worst = max(small.ranks, key=lambda m: m.rollout)
    assert "computed from shapes and the reserve estimates above, not measured on a GPU" in text
    assert f"    {'critic optimizer state':<48}{worst.kv_resume['critic optimizer state'] / GIB:8.2f}" in text
    assert f"  {'what remains':<50}{sum(worst.kv_resume.values()) / GIB:8.2f}" in text
    assert f"  {'= rollout':<50}{worst.rollout / GIB:8.2f}" in text


def _plans_with_and_without_offload():
    from vapo_megatron.config import parse_config
    from vapo_megatron.sizing.plan import make_plan

    return [make_plan(parse_config(CONFIG_32B, over)[0], QWEN25_32B, QWEN25_32B, world_size=64, gpu_memory_gib=80.0)
            for over in ([], ["trainer.offload_during_rollout=false", "rollout.sglang.mem_fraction=0.55"])]


def test_offload_takes_the_trainer_state_out_of_the_rollout_phase():
    from vapo_megatron.sizing.memory import SGLANG_RUNTIME_ITEM

    on, off = run_ranks(1, _plans_with_and_without_offload)[0]
    assert on.offload and not off.offload and not on.problems and not off.problems
    for m_on, m_off in zip(on.ranks, off.ranks):
        state = {k: v for k, v in m_off.kv_resume.items() if k.startswith(("actor ", "critic "))}
        assert len(state) == 6 and m_on.offloaded == state and not m_off.offloaded
        assert set(m_on.kv_resume) == set(m_off.kv_resume) - set(state)  # the reserve alone remains
        assert (sum(m_on.kv_resume.values()) + on.engine_share + m_on.reserve["rollout"][SGLANG_RUNTIME_ITEM]
                == m_on.rollout)
        assert m_on.training == m_off.training  # training holds the state either way
    # Same rollout peak: the 0.30 of the GPU the offload frees went to the engine's share.
    assert max(m.rollout for m in on.ranks) - max(m.rollout for m in off.ranks) < 0.05 * (1 << 30)
    assert on.kv_compare["offloaded"]["kv_cache"] == on.kv_cache and on.kv_compare["offloaded"]["configured"]
    assert off.kv_compare["resident"]["kv_cache"] == off.kv_cache and off.kv_compare["resident"]["configured"]
    assert on.kv_cache >= 1.5 * off.kv_cache
    assert abs(on.kv_compare["resident"]["kv_cache"] - off.kv_cache) < 0.05 * (1 << 30)
