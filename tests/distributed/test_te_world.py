"""The paths that matter, run in the TE world (megatron-core with Transformer Engine and Apex
importable, as in NGC images, through the pure-torch stand-ins of tests/doubles/te and
tests/doubles/apex; models built with TE's layer spec on the CPU, mcore/models.py te_spec), dense
and MoE, and across worlds (issue 43, part 1):

- a tiny Qwen2 (the demo's model) at TP=2 with sequence parallelism, and a tiny Qwen3-MoE at EP=2
  (TE's grouped-GEMM experts), with gradient_accumulation_fusion on as on every GPU node with TE
  and Apex (TE's linears and megatron's output layer add their weight gradients into main_grad;
  issue 55 item 6): two VAPO steps each, the engine's log-probs equal to the trainer's (the weight
  sync into the embedded engine); a resume from iteration 1 bitwise equal to the uninterrupted run,
  weights AND Adam moments of actor and critic; and iteration 2 run again from iteration 1 without
  the fusion (what a node with TE and no Apex runs) equal to the fused run;
- vapo-convert both ways: hf-to-mcore here loaded into a TE model gives transformers' logits,
  mcore-to-hf of the trainer's TE checkpoint equals the trainer's own HF export, and that
  checkpoint loaded into a TE model gives transformers' logits of the export;
- across worlds: hf-to-mcore's checkpoint written in the local world loads into the TE world's
  models, and the TE world's checkpoints (the trainer's, hf-to-mcore's) load into the local one;
- vapo-eval on a checkpoint draws the samples it draws from the HF model; vapo-plan says in the
  TE world what it says in the local one.

Cost: one TE-world interpreter drives everything (tests/helpers/te_world_runs.py: two trainer runs
of two steps and four of one, 2 ranks each); the local world adds three loads and a plan forked
from the suite's forkserver."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import te_world_runs as runs
from tests.helpers.dist_utils import run_ranks
from tests.helpers.tiny_hf import save_demo_sized
from tests.helpers.train_runs import ROOT, make_demo_data
from tests.helpers.worlds import drive_in_world, run_command

TOL = 1e-4  # float32 logits: Megatron's TP sums and transformers' single matmuls differ by rounding
# (TP, EP) of the loads and conversions; the MoE runs train at EP=2, and mcore-to-hf reads a
# checkpoint at EP=1 only (it reshards).
LAYOUTS = {"dense": (2, 1), "moe": (1, 1)}


def random_norms(model: Path, seed: int) -> None:
    """Every norm weight of an HF model drawn around 1: transformers initializes them to exactly 1,
    which hides a norm that a conversion or a layer spec leaves at its default (issue 43 defect 2)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(m.named_parameters()):
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    m.save_pretrained(model)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("te-world")
    data = make_demo_data(w / "data", n_train=64, n_eval=8, n_sft=16)
    save_demo_sized(w / "moe-model", data / "tokenizer", family="qwen3_moe")
    random_norms(data / "model", 1)
    random_norms(w / "moe-model", 2)
    return w


def model_dir(work: Path, kind: str) -> Path:
    return work / "data" / "model" if kind == "dense" else work / "moe-model"


@pytest.fixture(scope="module")
def te(work) -> dict:
    """The local world converts first (its checkpoints are the TE world's to load), then the TE
    world runs everything (te_world_runs.drive)."""
    local = {}
    for kind, (tp, ep) in LAYOUTS.items():
        local[kind] = str(work / f"{kind}-local-converted")
        run_ranks(tp, runs.load_rank, tp, 1, str(model_dir(work, kind)), {}, local[kind], timeout=600)
    out = drive_in_world("te_apex", runs.drive, str(work), local)
    print("TE world stages (s):", out["seconds"])  # shown with -s, or with a failure
    return out


def ok(result: dict) -> dict:
    assert "error" not in result, result["error"]
    return result


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_two_vapo_steps_run_with_te_modules_and_sync_into_the_engine(te, kind):
    r = ok(te[f"{kind}_train"])
    assert len(r["vapo"]) == 2, r["tail"]
    assert r["fused"], r["tail"]  # gradient_accumulation_fusion on, as with TE and Apex on a GPU
    for step in r["vapo"]:
        # Mean |engine - trainer| log-prob over the rollout's tokens, float32 on both sides.
        assert 0.0 <= step["rollout/logprob_diff"] < 1e-6, step
        assert all(torch.isfinite(torch.tensor(v)) for v in step.values()), step
    # The trainer's checkpoint holds TE modules' extra state: TE's spec ran, not megatron's local one.
    assert any("self_attention.linear_qkv._extra_state" in k for k in r["extra_state"]), r["extra_state"][:20]
    if kind == "moe":
        assert any("experts.linear_fc1._extra_state" in k for k in r["extra_state"]), r["extra_state"][:40]


def test_the_critic_at_its_own_layout_trains_in_the_te_world(te):
    """critic.parallel.tp=1 (DP=2) beside the actor at TP=2 with SP, both with TE's modules: the same
    rollouts (the actor is the same), so each step's figures equal the run at one layout up to the
    critic's float rounding at another TP (its sums run in another order)."""
    one, own = ok(te["dense_train"]), ok(te["dense_critic_layout"])
    assert len(own["vapo"]) == 2, own["tail"]
    assert any("self_attention.linear_qkv._extra_state" in k for k in own["extra_state"])
    for a, b in zip(one["vapo"], own["vapo"]):
        for key in ("critic/value_loss", "actor/pg_loss", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (key, a, b)


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_a_resume_is_bitwise_the_uninterrupted_run_adam_moments_included(te, kind):
    r = ok(te[f"{kind}_resume"])
    assert r["resumed"] and r["fused"]
    assert r["moments"] > 0  # the comparison covers Adam's exp_avg / exp_avg_sq
    assert not r["differ"], f"{len(r['differ'])} tensors differ after the resume: {r['differ'][:12]}"


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_the_fused_wgrad_accumulation_trains_as_the_unfused_one(te, kind):
    """Issue 55 item 6: iteration 2 without gradient_accumulation_fusion, from the fused run's
    iteration 1, ends where the fused run did: weights and Adam moments of actor and critic. The
    doubles compute dy^T x alike on both paths (tests/doubles/te .../module/linear.py _Gemm), so
    the MoE (untied embeddings) and the dense critic are bitwise; the dense actor ties its embedding
    to the output layer, whose two gradients the fused path adds into main_grad one after the other
    and the unfused one as their sum (megatron's DDP hook), so those sums round differently, and the
    gradient norm, the clipping and Adam's update follow: within float32 rounding of each tensor's
    scale (measured: at most 3e-6; a fused GEMM that wrote over main_grad instead of adding to it gave
    1e-2 for weights and above 1 for moments)."""
    r = ok(te[f"{kind}_unfused"])
    assert r["resumed"] and not r["fused"] and r["moments"] > 0
    bitwise = r["differ"] if kind == "moe" else [k for k in r["differ"] if not k.startswith("actor ")]
    assert not bitwise, f"{len(bitwise)} tensors differ: {bitwise[:12]}"
    assert len(r["relative"]) == len(r["differ"]), r["differ"]  # same keys and shapes
    assert max(r["relative"].values(), default=0.0) < 1e-4, r["relative"]


def loaded(r: dict, name: str) -> None:
    """A checkpoint loaded into this world's model gave transformers' logits of the same weights."""
    assert isinstance(r[name], float), r[name]  # else the load's traceback
    assert r[name] < TOL, (name, r[name])


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_hf_to_mcore_in_the_te_world_loads_into_a_te_model(te, kind):
    r = ok(te[f"{kind}_convert"])
    loaded(r, "converted_here")
    assert r["specs"]["converted_here"] == "transformer_engine"


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_the_trainers_te_checkpoint_loads_into_a_te_model(te, kind):
    r = ok(te[f"{kind}_convert"])
    loaded(r, "trainer")


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_mcore_to_hf_of_the_trainers_te_checkpoint_is_its_own_export(te, kind):
    r = ok(te[f"{kind}_convert"])
    assert not r["export_differs"], r["export_differs"][:12]


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_a_local_world_checkpoint_loads_in_the_te_world(te, kind):
    r = ok(te[f"{kind}_convert"])
    loaded(r, "local_converted")
    assert r["specs"]["local_converted"] == "transformer_engine"


@pytest.fixture(scope="module")
def back_in_the_local_world(te, work) -> dict:
    """The TE world's checkpoints (the trainer's last, hf-to-mcore's) loaded by local-spec models."""
    out = {}
    for kind, (tp, ep) in LAYOUTS.items():
        run = work / kind
        ckpts = {"te_trainer": str(run / "checkpoints" / "iter_0000002" / "actor"),
                 "te_converted": str(work / f"{kind}-te-converted")}
        if not all(Path(c).exists() for c in ckpts.values()):
            out[kind] = {"error": f"the TE world wrote no {sorted(ckpts)} for {kind} (see its own tests)"}
            continue
        (logits,) = [r
                     for r in run_ranks(tp * ep, runs.load_rank, tp, ep, str(model_dir(work, kind)), ckpts, timeout=600)
                     if r is not None]
        ids = runs.model_ids(model_dir(work, kind))
        want = {"te_trainer": runs.transformers_logits(run / "hf", ids),
                "te_converted": runs.transformers_logits(model_dir(work, kind), ids)}
        out[kind] = {k: (float((v - want[k]).abs().max()) if isinstance(v, torch.Tensor) else v)
                     for k, v in logits.items()}
    return out


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_te_world_checkpoints_load_in_the_local_world(back_in_the_local_world, kind):
    r = ok(back_in_the_local_world[kind])
    for name in ("te_trainer", "te_converted"):
        loaded(r, name)
        assert r[name + "/spec"] == "local"


def test_vapo_eval_reads_a_checkpoint_in_the_te_world(te):
    r = ok(te["eval"])
    assert r["files"] and r["same"], r


def test_vapo_plan_says_the_same_in_both_worlds(te, work):
    r = ok(te["plan"])
    assert r["code"] == 0, r["stderr"]
    config = str(ROOT / "configs" / "demo_cpu.yaml")
    code, stdout, stderr = run_command("vapo_megatron.plan", runs.plan_args(config, model_dir(work, "moe")))
    assert code == 0, stderr[-3000:]
    assert r["stdout"] == stdout
