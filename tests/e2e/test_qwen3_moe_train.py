"""vapo-train on a tiny Qwen3-MoE: torchrun, 2 ranks, the embedded engine, at EP=2 (TP=1, the two
data-parallel ranks each holding two of the four experts; VAPO, and DAPO: no critic, dynamic
sampling) and at TP=2 (sequence parallelism on, which megatron's MoE layer needs at TP > 1), with
the router's load-balancing loss on and routing replay on (the default for a MoE model), which
logs moe/routing_mismatch.

The demo data and tokenizer are the demo's (scripts/make_demo_data.py); its Qwen2 model is
replaced by a random-init transformers Qwen3MoeForCausalLM sized to that tokenizer (4 experts,
top-2, one dense layer of three). The engine (transformers' Qwen3-MoE, fused expert tensors) and
the trainer (megatron's MoE layers, tokens moved to their experts by all-to-all) compute the
rollout's log-probs independently, so `rollout/logprob_diff` at float32 rounding level says that
routing, experts and the synced weights agree at every step.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.quiet_check import library_noise
from tests.helpers.train_runs import (checkpoint_tensors, exported, hf_weights, make_demo_data, records,
                                      small_run_overrides, train_in_forks)


def write_tiny_qwen3_moe(model_dir: Path, tokenizer_dir: Path, *, seed: int = 0) -> None:
    """A random-init Qwen3MoeForCausalLM (untied, layer 1 dense) with the demo tokenizer."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = Qwen3MoeConfig(
        vocab_size=-(-len(tok) // 64) * 64, hidden_size=48, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, architectures=["Qwen3MoeForCausalLM"],
    )
    torch.manual_seed(seed)
    shutil.rmtree(model_dir, ignore_errors=True)
    Qwen3MoeForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def moe_demo(tmp_path_factory) -> Path:
    data = make_demo_data(tmp_path_factory.mktemp("moe-demo") / "data", n_train=64, n_eval=8, n_sft=16)
    write_tiny_qwen3_moe(data / "model", data / "tokenizer")
    return data


def _overrides(data: Path, run_dir: Path) -> list[str]:
    return [*small_run_overrides(data, run_dir), "model.moe_aux_loss_coeff=0.01"]


EP2 = ["parallel.tp=1", "parallel.ep=2"]
# name: (config, overrides). DAPO is configs/dapo.yaml (GRPO advantages, no critic, dynamic sampling): ~10 s.
LAYOUTS = {"ep2": ("demo_cpu.yaml", EP2), "tp2-sp": ("demo_cpu.yaml", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
           "ep2-dapo": ("dapo.yaml", [*EP2, "rollout.max_sampling_rounds=2"])}


@pytest.fixture(scope="module")
def ep2_run(moe_demo, tmp_path_factory) -> tuple[Path, str]:
    """Two VAPO steps at EP=2, uninterrupted, with the final checkpoint and HF export."""
    run_dir = tmp_path_factory.mktemp("moe-ep2") / "run"
    run = train_in_forks("demo_cpu.yaml", *_overrides(moe_demo, run_dir), *EP2, "trainer.export_hf=true")
    return run_dir, run.stdout + run.stderr


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vapo_train_runs_on_qwen3_moe_with_the_embedded_engine(moe_demo, ep2_run, tmp_path, layout):
    if layout == "ep2":
        run_dir, stdout = ep2_run
        # Quiet as the dense runs: torch's all_gather_into_tensor FutureWarning (megatron's MoE token
        # dispatch at EP > 1) was printed by every rank. (Forked ranks find transformers imported
        # before vapo-train could hide its loading bars; torchrun's do not: tests/e2e/test_train.py.)
        noise = [line for line in library_noise(stdout).splitlines() if not line.startswith("Loading weights")]
        assert not noise, "\n".join(noise)
    else:
        run_dir = tmp_path / "run"
        config, overrides = LAYOUTS[layout]
        stdout = train_in_forks(config, *_overrides(moe_demo, run_dir), *overrides).stdout
    vapo = [r for r in records(run_dir) if r["phase"] == "vapo"]
    assert len(vapo) == 2, stdout[-3000:]
    roles = ("actor",) if layout == "ep2-dapo" else ("actor", "critic")  # GRPO has no critic
    for r in vapo:
        # Mean |engine - trainer| log-prob over response tokens, float32 on both sides: rounding
        # only (a misrouted token or a misplaced expert weight gives ~1e-2 and more).
        assert 0.0 <= r["rollout/logprob_diff"] < 1e-6, r["rollout/logprob_diff"]
        # Routing replay is on (a MoE model): the engine's routes reach each trainer router at their
        # tokens through scoring, micro-batches and EP. Both compute in float32, so the routers' own
        # choice agrees with the engine's on (nearly) every token; misplaced routes disagree on most.
        assert 0.0 <= r["moe/routing_mismatch"] < 0.01, r["moe/routing_mismatch"]
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/grad_norm") + ("critic/value_loss",) * (len(roles) > 1))
        # megatron's aux_loss is E * sum_i f_i * P_i with f_i the fraction of the top-k choices
        # that go to expert i and P_i its mean router probability: 1 for a balanced load, which a
        # random-init router (std 0.02, near-uniform) is close to. A reduction over the wrong
        # ranks (TP shards counted twice, stages or micro-batches not averaged) is off by >= 2x.
        for role in roles:
            assert 0.95 < r[f"{role}/moe_aux_loss"] < 1.5, r[f"{role}/moe_aux_loss"]
    if layout == "ep2-dapo":
        assert all(r["rollout/sampling_rounds"] >= 1 for r in vapo) and not any("critic/value_loss" in r for r in vapo)


def test_resume_at_ep2_reaches_the_same_state_and_exports_every_expert(moe_demo, ep2_run, tmp_path):
    """Stopped after one step and resumed, an EP=2 run ends with the same weights AND optimizer
    state (each EP rank's experts and their Adam moments, through megatron's dist checkpoint) as
    the uninterrupted run; its HF export holds every expert of every MoE layer."""
    full_dir, _ = ep2_run
    run_dir = tmp_path / "run"
    train_in_forks("demo_cpu.yaml", *_overrides(moe_demo, run_dir), *EP2, "trainer.total_steps=1")
    proc = train_in_forks("demo_cpu.yaml", *_overrides(moe_demo, run_dir), *EP2, "trainer.export_hf=true")
    assert "resumed from" in proc.stdout + proc.stderr
    last = (full_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == last
    for role in ("actor", "critic"):
        want = checkpoint_tensors(full_dir / "checkpoints" / last / role)
        have = checkpoint_tensors(run_dir / "checkpoints" / last / role)
        assert want.keys() == have.keys()
        assert any("experts" in k and "exp_avg" in k for k in want), sorted(want)[:20]  # expert Adam state is in it
        for name in want:
            assert torch.equal(want[name], have[name]), f"{role} {name} differs after resume"
    # The trainer's export (experts gathered over EP) equals the checkpoint converted at EP=1.
    final = hf_weights(run_dir / "hf")
    assert {f"model.layers.{layer}.mlp.experts.{e}.{p}.weight" for layer in (0, 2) for e in range(4)
            for p in ("gate_proj", "up_proj", "down_proj")} <= final.keys()
    actor = exported(run_dir / "checkpoints" / last / "actor", tmp_path / "actor-hf")
    assert final.keys() == actor.keys() and all(torch.equal(final[k], actor[k]) for k in actor)
