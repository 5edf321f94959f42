"""vapo-plan's step-time model (vapo_megatron/sizing/step_time.py and its inputs) against independent references:

- published parameter counts (Llama-3.1-8B's 8,030,261,248; Qwen3-32B's 32.8B and Qwen3-30B-A3B's
  30.5B on their model cards) and a hand count of a toy shape;
- a decode step and a rollout worked by hand;
- NeMo-RL's published GRPO step times on H100, with vapo-plan configured like each run (the YAML
  below; settings read from NVIDIA-NeMo/RL at the source, docs/slurm.md "Step time and cost"):
    * Llama-3.1-8B-Instruct on 1 x 8 H100, Megatron backend: step 112 s = generation 58 + get
      logprobs 18 + policy training 28 + refit 5 (blog "NeMo-RL V0.3", 2025-07-21, quoted in
      NVIDIA-NeMo/RL issue #959), 795 generated tokens per sample;
    * Qwen3-32B on 8 x 8 H100, TP 4 PP 2: step 213 s = generation 96 + get logprobs 40 + policy
      training 68 + refit 7, 3,283 generated tokens per sample (the same blog post);
    * Qwen3-32B on 4 x 8 H100, TP 4 PP 4: step 376 s, 571 tokens/s/GPU, 3,251 tokens per sample
      (docs/about/performance-summary.md, NeMo RL v0.5, H100 BF16; no per-phase figures).
  Each prediction must be within 2x of each published figure (the agreement docs/slurm.md reports).
Pure Python: no torch, megatron or process launch.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from model_providers.presets import preset
from vapo_megatron.config import parse_config
from vapo_megatron.sizing.flops import Shapes, forward_flops_per_token, shapes_from_hf
from vapo_megatron.sizing.hardware import GPUS, gpu_from_device_name, link_bytes_s, on_nvlink
from vapo_megatron.sizing.step_config import (
    option_problems,
    predicted_step_and_save,
    setup_from_config,
    without_critic_delta,
)
from vapo_megatron.sizing.step_time import decode_step_s, estimate, partial_rollout, rollout

H100 = GPUS["h100"]

# ---- shapes, by hand and from model cards ---------------------------------------------------------------


def test_parameter_counts_match_the_published_ones():
    # meta-llama/Llama-3.1-8B: 8,030,261,248 parameters (the safetensors' total), untied.
    assert shapes_from_hf(preset("llama3.1-8b")).params() == 8_030_261_248
    # Qwen/Qwen3-32B model card: 32.8B; Qwen/Qwen3-30B-A3B: 30.5B in total, 3.3B activated.
    assert abs(shapes_from_hf(preset("qwen3-32b")).params() / 32.8e9 - 1) < 0.005
    moe = shapes_from_hf(preset("qwen3-30b-a3b"))
    assert abs(moe.params() / 30.5e9 - 1) < 0.005
    # Activated: the matmul weights a token meets (2 FLOPs each) + its embedding row.
    activated = forward_flops_per_token(moe, context=0, lm_head=True) / 2 + moe.vocab * moe.hidden
    assert abs(activated / 3.3e9 - 1) < 0.03


def test_a_toy_shape_counted_by_hand():
    toy = Shapes(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=10, tied=False, qkv_bias=True,
                 qk_norm=False)
    # per layer: q/k/v 8 x (2 + 2) x 4 = 128, their biases 16, o 2 x 4 x 8 = 64, 2 norms 16, MLP 3 x 8 x 16 = 384
    # -> 608; x 2 layers + embedding 80 + final norm 8 + LM head 80.
    assert toy.params() == 2 * 608 + 80 + 8 + 80 == 1384
    assert toy.params(critic=True) == 2 * 608 + 80 + 8 + 9  # value head [1, 8] + bias
    # forward FLOPs per token at 5 keys: per layer 2 x (128 + 64) + attention 4 x 2 x 4 x 5 + MLP 2 x 384,
    # x 2 layers, + LM head 2 x 8 x 10.
    assert forward_flops_per_token(toy, context=5, lm_head=True) == 2 * (384 + 160 + 768) + 160 == 2784
    assert toy.hf_tensors() == 2 * (6 + 3 + 3) + 2 + 1  # q k v o, 2 norms, 3 biases, gate up down; embed, norm, head


def test_a_decode_step_and_a_rollout_worked_by_hand():
    llama = shapes_from_hf(preset("llama3.1-8b"))
    # One sequence at 1,000 tokens of context on one H100: the bf16 weights (2 x 8,030,261,248 bytes)
    # and its KV cache (1,000 x 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes) at 60% of 3.35 TB/s,
    # + 1.5 ms host overhead (TP 1: no all-reduce). Its matmuls (~16 GFLOP) take far less.
    by_hand = (2 * 8_030_261_248 + 1000 * 32 * 8 * 128 * 2 * 2) / (0.6 * 3.35e12) + 1.5e-3
    assert decode_step_s(H100, llama, engine_tp=1, batch=1, context=1000) == pytest.approx(by_hand, rel=1e-12)
    # 2 engines, 10 samples of 2 prompts: 5 per engine; a KV cache of 3,000 tokens holds 3 sequences
    # of 100 + 800 tokens: 5/3 waves of 800 steps at context 100 + 400, then the longest response
    # alone for 2,000 - 800 steps at context 100 + (800 + 2,000) / 2.
    r = rollout(H100, llama, engine_tp=1, engines=2, samples=10, prompts=2, prompt_tokens=100, response_tokens=800,
                max_response_tokens=2000, kv_tokens=3000)
    assert (r.concurrency, r.waves) == (3, pytest.approx(5 / 3))
    bulk = 5 / 3 * 800 * decode_step_s(H100, llama, engine_tp=1, batch=3, context=500)
    tail = 1200 * decode_step_s(H100, llama, engine_tp=1, batch=1, context=1500)
    # Prefill: one prompt per engine, 100 tokens at 50 keys on average, at the dense MFU 0.40.
    prefill = 100 * forward_flops_per_token(llama, context=50, lm_head=True) / (0.40 * 989e12)
    assert r.prefill_s == pytest.approx(prefill) and r.seconds == pytest.approx(bulk + tail + prefill)


def test_a_partial_rollout_worked_by_hand():
    """rollout.partial (issue 47): the rollout above with one spare batch and max_staleness 1. In
    flight 2 x 5 samples per engine, of which the KV cache holds 3: the same 5/3 waves of 800 steps;
    the longest response gets those 1,333 steps in each of the 2 steps it may span, so it decodes
    alone for 2,000 - 2,667 < 0 steps: no tail; prefill adds the carried responses that were running
    when the step stopped, 3 per engine (100 + 400 tokens at 250 keys), to the prompt."""
    llama = shapes_from_hf(preset("llama3.1-8b"))
    shape = dict(engine_tp=1, engines=2, samples=10, prompts=2, prompt_tokens=100, response_tokens=800,
                 max_response_tokens=2000, kv_tokens=3000)
    r = partial_rollout(H100, llama, **shape, spare_batches=1, max_staleness=1)
    assert (r.concurrency, r.waves) == (3, pytest.approx(5 / 3))
    bulk = 5 / 3 * 800 * decode_step_s(H100, llama, engine_tp=1, batch=3, context=500)
    prompt = 100 * forward_flops_per_token(llama, context=50, lm_head=True)
    prefill = (prompt + 3 * 500 * forward_flops_per_token(llama, context=250, lm_head=True)) / (0.40 * 989e12)
    assert r.prefill_s == pytest.approx(prefill) and r.seconds == pytest.approx(bulk + prefill)
    prefill = (prompt + 5 * 500 * forward_flops_per_token(llama, context=250, lm_head=True)) / (0.40 * 989e12)
    # A bigger KV cache holds all 10 in flight: one wave of 800 steps at batch 10 (5/10 of the
    # samples per step), and the longest response then has 2,000 - 2 x 400 = 1,200 steps alone;
    # all 5 carried responses per engine were running.
    big = partial_rollout(H100, llama, **(shape | {"kv_tokens": 100_000}), spare_batches=1, max_staleness=1)
    assert (big.concurrency, big.waves) == (10, 0.5)
    tail = 1200 * decode_step_s(H100, llama, engine_tp=1, batch=1, context=1500)
    assert big.seconds == pytest.approx(0.5 * 800 * decode_step_s(H100, llama, engine_tp=1, batch=10, context=500)
                                        + tail + prefill)
    assert big.seconds < rollout(H100, llama, **(shape | {"kv_tokens": 100_000})).seconds


def test_vapo_plan_prints_the_step_with_partial_rollout_beside_the_synchronous_one():
    from vapo_megatron.sizing.report import format_step_time

    hf = preset("qwen2.5-32b")
    for name in ("qwen2.5_32b_vapo", "qwen2.5_32b_dapo", "qwen3_32b_vapo"):
        for enabled in ("false", "true"):
            cfg, problems = parse_config(f"configs/{name}.yaml", [f"rollout.partial.enabled={enabled}"])
            assert problems == []
            setup = setup_from_config(cfg, hf, hf if cfg.algo.estimator == "gae" else None, world=64, gpus_per_node=8,
                                      gpu=H100)
            est = estimate(H100, setup)
            assert est.rollout_partial_s < est.rollout_sync_s
            want = est.rollout_partial_s if enabled == "true" else est.rollout_sync_s
            assert est.phases["rollout"].seconds == want
            line = next(x for x in format_step_time(est, cfg).splitlines() if x.startswith("  partial rollout"))
            assert f"rollout.partial.enabled={enabled}" in line
            assert f"rollout {est.rollout_partial_s:,.1f} s against {est.rollout_sync_s:,.1f} s" in line


# ---- NeMo-RL's published runs ------------------------------------------------------------------------------

# NeMo-RL's GRPO math recipes as vapo-megatron settings. Common to all three (examples/configs/
# grpo_math_1B(_megatron).yaml at v0.3.0 / v0.5.0 and the blog's footnote): 64 prompts x 32
# generations = 2,048 samples (rollout batch), train global batch 512 (4 optimizer steps),
# sequence packing with 4,096-token micro-batches (train_micro_batch_size 1 x max_total_sequence_length),
# vLLM colocated at gpu_memory_utilization 0.6 (the trainer's state offloaded while it generates),
# no activation checkpointing, the distributed optimizer, checkpointing disabled (save_every far
# off), a reference policy for the KL term (one more forward at scoring, below). max_model_len
# 4,096 covers prompt + response: the longest response is 4,096 - ~100 prompt tokens.
NEMO_RL_GRPO = """
model: {dtype: bfloat16, recompute_activations: false}
algo: {estimator: grpo, value_pretrain_steps: 0, mini_batches: 4, ppo_epochs: 1, nll_coef: 0.0}
rollout: {engine: sglang, prompts_per_step: 64, n_samples: 32, max_new_tokens: 3996, sglang: {mem_fraction: 0.6}}
actor_optim: {distributed_optimizer: true}
data: {max_prompt_tokens: 512}
trainer: {micro_batch_tokens: 4096, offload_during_rollout: true, save_every: 1000000, total_steps: 1}
"""
PROMPT_TOKENS = 100  # OpenMathInstruct-2 with cot.txt: 571 x 32 x 376 / 2,048 - 3,251 = 104 prompt tokens


def nemo_rl_estimate(tmp_path, *, model: str, gpus: int, layout: list[str], response_tokens: int):
    path = tmp_path / "nemo_rl_grpo.yaml"
    path.write_text(NEMO_RL_GRPO)
    cfg, problems = parse_config(str(path), layout)
    assert problems == []
    setup = setup_from_config(cfg, preset(model), None, world=gpus, gpus_per_node=8, gpu=H100,
                              response_tokens=response_tokens, prompt_tokens=PROMPT_TOKENS)
    return estimate(H100, replace(setup, reference_forwards=1))


def published_phases(est) -> dict[str, float]:
    """Our phases under NeMo-RL's timer names: its refit wraps the offload before and after the weight
    update (grpo.py refit_policy_generation); its checkpointing was off."""
    p = {name: phase.seconds for name, phase in est.phases.items()}
    return {"generation": p["rollout"], "get logprobs": p["score"], "policy training": p["actor_update"],
            "refit": p["offload"] + p["sync"] + p["onload"], "step": est.step_s - p["checkpoint"]}


def within_2x(predicted: dict[str, float], published: dict[str, float]) -> None:
    for name, value in published.items():
        assert 0.5 <= predicted[name] / value <= 2.0, (name, predicted[name], value)


def test_llama_8b_on_one_h100_node_within_2x_of_nemo_rl(tmp_path):
    est = nemo_rl_estimate(tmp_path, model="llama3.1-8b", gpus=8, response_tokens=795,
                           layout=["parallel.tp=1", "parallel.pp=1", "rollout.sglang.tp=1"])
    assert "critic_update" not in est.phases  # GRPO: no critic
    within_2x(published_phases(est), {"generation": 58, "get logprobs": 18, "policy training": 28, "refit": 5,
                                      "step": 112})


def test_qwen3_32b_on_eight_h100_nodes_within_2x_of_nemo_rl(tmp_path):
    est = nemo_rl_estimate(tmp_path, model="qwen3-32b", gpus=64, response_tokens=3283,
                           layout=["parallel.tp=4", "parallel.pp=2", "parallel.sequence_parallel=true",
                                   "rollout.sglang.tp=4"])
    within_2x(published_phases(est), {"generation": 96, "get logprobs": 40, "policy training": 68, "refit": 7,
                                      "step": 213})


def test_qwen3_32b_on_four_h100_nodes_within_2x_of_nemo_rl(tmp_path):
    est = nemo_rl_estimate(tmp_path, model="qwen3-32b", gpus=32, response_tokens=3251,
                           layout=["parallel.tp=4", "parallel.pp=4", "parallel.sequence_parallel=true",
                                   "rollout.sglang.tp=4"])
    predicted = published_phases(est)
    predicted["tokens/s/GPU"] = est.tokens_per_s_per_gpu
    within_2x(predicted, {"step": 376, "tokens/s/GPU": 571})


# ---- the critic, the options, the GPU names ----------------------------------------------------------------


def test_the_critic_phases_exist_only_with_a_critic():
    cfg, _ = parse_config("configs/qwen2.5_32b_vapo.yaml", [])
    hf = preset("qwen2.5-32b")
    vapo = estimate(H100, setup_from_config(cfg, hf, hf, world=64, gpus_per_node=8, gpu=H100))
    dapo_cfg, _ = parse_config("configs/qwen2.5_32b_dapo.yaml", [])
    dapo = setup_from_config(dapo_cfg, hf, hf, world=64, gpus_per_node=8, gpu=H100)
    assert dapo.critic is None and "critic_update" not in estimate(H100, dapo).phases
    assert {"score", "critic_update", "actor_update"} <= set(vapo.phases)
    # What the critic costs: about one more forward at scoring and one more update, so more than
    # the actor update alone (the critic has no LM head) and less than twice as much.
    delta = without_critic_delta(H100, dapo)
    assert 0.9 * estimate(H100, dapo).phases["actor_update"].seconds < delta
    # Value pretraining iterations run everything but the actor update.
    assert vapo.pretrain_step_s == pytest.approx(vapo.step_s - vapo.phases["actor_update"].seconds)


def test_bad_time_options_are_named_one_each():
    ok = dict(gpu="h100", response_tokens=5000, prompt_tokens=200, storage_gb_s=1.0, eval_prompts=30,
              max_new_tokens=20480, max_prompt_tokens=2048)
    assert option_problems(**ok) == []
    assert option_problems(**{**ok, "gpu": None}) == []  # no --gpu: no time table, nothing to check there
    (msg,) = option_problems(**{**ok, "gpu": "x100"})
    assert msg == "--gpu=x100 is not a GPU this model knows; known: h100, h200, a100, b200, gb200"
    (msg,) = option_problems(**{**ok, "response_tokens": 30000})
    assert msg.startswith("--mean-response-tokens=30000 is more than rollout.max_new_tokens=20480")
    for option, key in (("--mean-response-tokens", "response_tokens"), ("--mean-prompt-tokens", "prompt_tokens"),
                        ("--storage-gb-per-s", "storage_gb_s"), ("--eval-prompts", "eval_prompts")):
        for bad in (0, -1, float("nan"), float("inf")):  # inf: issue 44 item 5
            (msg,) = option_problems(**{**ok, key: bad})
            assert msg == f"{option}={bad:g} must be a finite number > 0" and "\n" not in msg


def test_the_trainer_gets_a_prediction_only_for_a_gpu_with_rates():
    cfg, _ = parse_config("configs/qwen2.5_32b_vapo.yaml", [])
    hf = preset("qwen2.5-32b")
    step_s, save_s = predicted_step_and_save(cfg, hf, hf, world=64, gpus_per_node=8,
                                             device_name="NVIDIA H100 80GB HBM3")
    assert step_s == estimate(H100, setup_from_config(cfg, hf, hf, world=64, gpus_per_node=8, gpu=H100)).step_s
    # One save at the default 1 GB/s: every parameter of actor and critic, bf16 + fp32 master + 2 Adam moments.
    s = shapes_from_hf(hf)
    assert save_s == pytest.approx((s.params() + s.params(critic=True)) * (2 + 4 + 4 + 4) / 1e9)
    assert predicted_step_and_save(cfg, hf, hf, world=64, gpus_per_node=8, device_name="NVIDIA L40S") == (0.0, 0.0)
    demo, _ = parse_config("configs/demo_cpu.yaml", [])  # the embedded engine: not modelled
    assert predicted_step_and_save(demo, hf, hf, world=2, gpus_per_node=2, device_name="NVIDIA H100") == (0.0, 0.0)


def test_device_names_map_to_their_rates():
    assert gpu_from_device_name("NVIDIA H100 80GB HBM3") is GPUS["h100"]
    assert gpu_from_device_name("NVIDIA H200") is GPUS["h200"]
    assert gpu_from_device_name("NVIDIA A100-SXM4-80GB") is GPUS["a100"]
    assert gpu_from_device_name("NVIDIA A100-SXM4-40GB") is None
    assert gpu_from_device_name("NVIDIA B200") is GPUS["b200"]
    assert gpu_from_device_name("NVIDIA GB200") is GPUS["gb200"]
    assert gpu_from_device_name("NVIDIA L40S") is None


def test_a_group_is_on_nvlink_only_when_no_node_boundary_falls_inside_it():
    """A group of `span` consecutive ranks starts at a multiple of span: with 7 GPUs per node, TP=2's
    group of ranks 6 and 7 spans two nodes (span <= node was taken as enough), while TP=7 and TP=1 fit."""
    h100, gb200 = GPUS["h100"], GPUS["gb200"]
    assert not on_nvlink(h100, 2, 7, 56) and not on_nvlink(h100, 4, 7, 56)
    assert on_nvlink(h100, 7, 7, 56) and on_nvlink(h100, 1, 7, 56)
    assert on_nvlink(h100, 8, 8, 64) and on_nvlink(h100, 4, 8, 64) and not on_nvlink(h100, 16, 8, 64)
    assert not on_nvlink(h100, 6, 8, 48)  # ranks 6..11 cross the first node's end
    assert on_nvlink(h100, 3, 6, 6)  # one node of 6: every group inside it
    # GB200 NVL72: the domain is the rack of 72, whatever the GPUs per node.
    assert on_nvlink(gb200, 8, 4, 144) and not on_nvlink(gb200, 16, 4, 144) and on_nvlink(gb200, 16, 4, 16)
    assert link_bytes_s(h100, 2, 7, 56) == link_bytes_s(h100, 16, 8, 64) < link_bytes_s(h100, 7, 7, 56)


def test_vapo_plan_counts_the_evaluations_the_trainer_runs():
    """Before RL, after every eval.every RL steps short of the last, and at the end; eval.every=0:
    none between (issue 55 item 13; trainer.run's rule)."""
    hf = preset("qwen2.5-32b")
    for every, want in ((0, 2), (1, 2 + 49), (10, 2 + 4), (50, 2), (100, 2)):
        cfg, problems = parse_config("configs/qwen2.5_32b_vapo.yaml", [f"eval.every={every}", "trainer.total_steps=50"])
        assert problems == []
        assert setup_from_config(cfg, hf, hf, world=64, gpus_per_node=8, gpu=H100).evals == want, every
