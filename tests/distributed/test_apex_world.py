"""The Apex world (issue 43): megatron-core's Apex branches, run on the CPU through the stand-ins
of tests/doubles/apex/ (Apex without Transformer Engine), do what the local world does.

One fresh Apex-world interpreter does it all (tests/helpers/world_acceptance.py world_side), each
item reported on its own: dense (the demo's Qwen2) and MoE (a tiny Qwen3-MoE, one rank: EP=1) each train
two VAPO steps with the embedded engine, whose log-probs after every weight sync must equal the
trainer's; a run stopped after one step and resumed ends bitwise equal to the uninterrupted one,
weights and Adam moments (Apex's FusedAdam) of actor and critic, and no moment was wiped;
vapo-convert takes tiny Qwen3, Llama and Qwen3-MoE models both ways with logits equal to
transformers' and the export equal to the source; vapo-eval reads the trainer's checkpoint;
vapo-plan sizes the Qwen3 configs. Across worlds (the pytest process is the local world):
checkpoints converted in the local world load in the Apex world and those converted there load
here, both with transformers' logits; vapo-eval of the Apex run's checkpoint draws the same
samples in both worlds; vapo-plan prints the same plan. And a GPU node's settings with Apex
(on_gpu=True: the masked-softmax fusion on) build a bf16 model that runs Apex's softmax kernel and
steps Apex's FusedAdam.

Cost: ~85 CPU-s (measured 84 on the shared 2-core machine; 200 s wall at load 10): the Apex-world
interpreter and its forkserver, six one-rank trainer runs (three per model: uninterrupted, one
step, the resume), one rank each for the conversions, vapo-eval, vapo-plan and the GPU settings;
the local world adds two conversion ranks, a vapo-eval and a vapo-plan forked from the suite's
forkserver.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.tiny_hf import input_ids, save_tiny
from tests.helpers.world_acceptance import PLANS, convert_side, eval_side, plan_side, world_side
from tests.helpers.worlds import drive_in_world

KINDS = ("qwen3", "llama", "qwen3_moe")
TOL = 1e-4  # float32 logits, megatron against transformers (test_convert's tolerance)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny random HF models and transformers' logits on a fixed batch."""
    root = tmp_path_factory.mktemp("hf")
    ids = input_ids()
    dirs, refs = {}, {}
    for i, kind in enumerate(KINDS):
        dirs[kind] = root / kind
        with torch.no_grad():
            refs[kind] = save_tiny(dirs[kind], kind=kind, seed=10 + i)(ids).logits
    return dirs, refs, ids


@pytest.fixture(scope="module")
def worlds(models, tmp_path_factory):
    """The local world converts first; the Apex world does everything, loading the local
    checkpoints; the local world then loads the Apex world's and evaluates and plans as it did."""
    dirs, _, ids = models
    work = tmp_path_factory.mktemp("apex-world")
    local = convert_side(dirs, work / "local", {}, ids)
    local_ckpts = {k: work / "local" / f"{k}-mcore" for k in dirs if local[k][0] == "ok"}
    apex = drive_in_world("apex", world_side, work / "apex", dirs, local_ckpts, ids, timeout=1800)
    back = convert_side({}, work / "local-back", {k: work / "apex" / "convert" / f"{k}-mcore" for k in dirs}, ids)
    local_eval = None
    if apex.get("eval", ("error",))[0] == "ok":
        local_eval = eval_side(Path(apex["dense"][1]["checkpoint"]), work / "apex" / "data", work / "local-eval")
    return {"local": local, "apex": apex, "back": back, "local_eval": local_eval, "local_plan": plan_side(PLANS),
            "work": work}


def item(results: dict, name: str):
    status, value = results[name]
    assert status == "ok", f"{name}:\n{value}"
    return value


def check_training(run: dict) -> None:
    vapo = [r for r in run["records"] if r["phase"] == "vapo"]
    assert len(vapo) == 2, run["output"]
    for r in vapo:
        # The engine's log-probs after each weight sync against the trainer's: rounding only.
        assert 0.0 <= r["rollout/logprob_diff"] < 1e-6, r["rollout/logprob_diff"]
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "critic/value_loss", "actor/grad_norm"))
    assert run["resumed"] and run["part_last"] == run["last"]
    for role in ("actor", "critic"):
        report = run[role]
        assert report["same_keys"] and report["moments"] > 0, (role, report)
        assert not report["differ"], f"{role}: differs after the resume: {report['differ'][:10]}"
        assert not report["zero_moments"], f"{role}: Adam moments all zero: {report['zero_moments'][:10]}"


def test_dense_trains_syncs_and_resumes_bitwise(worlds):
    check_training(item(worlds["apex"], "dense"))


def test_moe_trains_syncs_and_resumes_bitwise(worlds):
    run = item(worlds["apex"], "moe")
    check_training(run)
    for r in run["records"]:
        if r["phase"] == "vapo":
            assert 0.95 < r["actor/moe_aux_loss"] < 1.5  # test_families_train's bounds


@pytest.mark.parametrize("kind", KINDS)
def test_convert_both_ways_matches_transformers(models, worlds, kind):
    dirs, refs, _ = models
    converted = item(item(worlds["apex"], "convert"), kind)
    torch.testing.assert_close(converted, refs[kind], atol=TOL, rtol=0)
    source = load_file(dirs[kind] / "model.safetensors")
    exported = {}
    for f in sorted((worlds["work"] / "apex" / "convert" / f"{kind}-hf").glob("*.safetensors")):
        exported.update(load_file(f))
    assert exported.keys() == source.keys()
    for k, v in source.items():
        assert torch.equal(exported[k], v), k


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoints_cross_between_local_and_apex_worlds(models, worlds, kind):
    _, refs, _ = models
    torch.testing.assert_close(item(worlds["local"], kind), refs[kind], atol=TOL, rtol=0)
    torch.testing.assert_close(item(item(worlds["apex"], "convert"), f"foreign-{kind}"), refs[kind], atol=TOL, rtol=0)
    torch.testing.assert_close(item(worlds["back"], f"foreign-{kind}"), refs[kind], atol=TOL, rtol=0)


def test_vapo_eval_reads_the_trainers_checkpoint_as_the_local_world_does(worlds):
    samples = item(worlds["apex"], "eval")
    assert len(samples) == 8 * 4 and worlds["local_eval"] == samples


def test_vapo_plan_sizes_the_models_as_the_local_world_does(worlds):
    plans = item(worlds["apex"], "plan")
    assert plans.keys() == worlds["local_plan"].keys()
    for name, (code, text, sizes) in plans.items():
        local_code, local_text, local_sizes = worlds["local_plan"][name]
        assert code == local_code == 0, text[-2000:]
        assert text == local_text and sizes == local_sizes, name


def test_a_gpu_node_with_apex_runs_megatrons_fused_softmax_and_apex_adam(worlds):
    """The project's GPU settings where Apex imports and TE does not (an NGC image without TE):
    the masked-softmax fusion on (Apex's kernels import), the wgrad and RoPE fusions off (they need
    TE), and that model runs: the fused softmax gives the unfused logits, and one bf16 update steps
    Apex's FusedAdam with the gradient norm and clipping through amp_C."""
    got = item(worlds["apex"], "gpu_node")
    assert got["masked_softmax_fusion"] and not got["gradient_accumulation_fusion"] and not got["apply_rope_fusion"]
    assert not got["use_cpu_initialization"]  # built as on the GPU
    # One causal kernel per layer (4); the same float32 softmax of the same bf16 scores as megatron's
    # unfused path (its 1/sqrt(d) is in the score matmul, the kernel's scale is 1).
    assert got["fused_calls"] == 4 and got["logits_diff"] == 0.0
    assert got["adam"] == {"apex.optimizers.fused_adam"}
    applied, grad_norm = got["step"]
    assert applied and math.isfinite(grad_norm) and grad_norm > 1e-4
    assert got["calls"]["l2norm"] >= 1 and got["calls"]["scale"] >= 1
