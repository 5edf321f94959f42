"""vapo-train on a tiny Llama and a tiny Qwen3-MoE: 2 ranks forked as torchrun would start them,
the embedded engine. Llama (llama3 RoPE scaling on) at TP=2. Qwen3-MoE at EP=2 (TP=1, the two
data-parallel ranks each holding two of the four experts; VAPO, and DAPO: no critic, dynamic
sampling) and at TP=2 (sequence parallelism on, which megatron's MoE layer needs at TP > 1), with
the router's load-balancing loss on and routing replay on (the default for a MoE model), which
logs moe/routing_mismatch. Then the family extras: an unsupported Llama rope setting refused by
vapo-train, vapo-convert and vapo-plan in one line (vapo-eval runs the HF model with transformers
or SGLang, never megatron, so it does not refuse what only megatron cannot express), and a
Qwen3-MoE run at EP=2 stopped, resumed and exported. vapo-train, vapo-plan and the export's
vapo-convert run their main on ranks forked from the suite's preloaded forkserver
(tests/helpers/train_runs.py command_in_forks: main's return value is the exit code, its output
the command's), vapo-convert's refusal in this process.

The demo data and tokenizer are the demo's (scripts/make_demo_data.py), made once; its Qwen2 model
is replaced by random-init transformers models sized to that tokenizer (tests/helpers/tiny_hf.py
save_demo_sized). The engine (transformers' model; fused expert tensors) and the trainer
(megatron's GPTModel; tokens moved to their experts by all-to-all) compute the rollout's log-probs
independently, so `rollout/logprob_diff` at float32 rounding level says that megatron's llama3
RoPE, routing, experts and the weights synced through the family table are transformers' at
every step.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.quiet_check import library_noise
from tests.helpers.tiny_hf import save_demo_sized
from tests.helpers.train_runs import (
    ROOT,
    checkpoint_tensors,
    command_in_forks,
    exported,
    hf_weights,
    launch_in_forks,
    make_demo_data,
    records,
    small_run_overrides,
    train_in_forks,
)

EP2 = ["parallel.tp=1", "parallel.ep=2"]
# name: (family, config, overrides). DAPO is configs/dapo.yaml (GRPO advantages, no critic, dynamic
# sampling): ~10 s. "qwen3_moe-ep2" is the moe_ep2_run fixture's (the resume test's reference).
RUNS = {
    "llama-tp2": ("llama", "demo_cpu.yaml", ["parallel.tp=2"]),
    "qwen3_moe-ep2": ("qwen3_moe", "demo_cpu.yaml", EP2),
    "qwen3_moe-tp2-sp": ("qwen3_moe", "demo_cpu.yaml", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "qwen3_moe-ep2-dapo": ("qwen3_moe", "dapo.yaml", [*EP2, "rollout.max_sampling_rounds=2"]),
}


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    """The demo's data and tokenizer, with each family's model in data/<family>."""
    data = make_demo_data(tmp_path_factory.mktemp("families-demo") / "data", n_train=64, n_eval=8, n_sft=16)
    for family in ("llama", "qwen3_moe"):
        save_demo_sized(data / family, data / "tokenizer", family=family)
    return data


def _overrides(data: Path, run_dir: Path, family: str) -> list[str]:
    moe = ["model.moe_aux_loss_coeff=0.01"] if family == "qwen3_moe" else []
    return [*small_run_overrides(data, run_dir), f"model.hf_path={data / family}", *moe]


@pytest.fixture(scope="module")
def moe_ep2_run(demo_data, tmp_path_factory) -> tuple[Path, str]:
    """Two VAPO steps of Qwen3-MoE at EP=2, uninterrupted, with the final checkpoint and HF export."""
    run_dir = tmp_path_factory.mktemp("moe-ep2") / "run"
    run = train_in_forks("demo_cpu.yaml", *_overrides(demo_data, run_dir, "qwen3_moe"), *EP2, "trainer.export_hf=true")
    return run_dir, run.stdout + run.stderr


@pytest.mark.parametrize("name", list(RUNS))
def test_vapo_train_runs_with_the_embedded_engine(request, demo_data, tmp_path, name):
    family, config, overrides = RUNS[name]
    if name == "qwen3_moe-ep2":
        run_dir, stdout = request.getfixturevalue("moe_ep2_run")
        # Quiet as the dense runs: torch's all_gather_into_tensor FutureWarning (megatron's MoE token
        # dispatch at EP > 1) was printed by every rank. (Forked ranks find transformers imported
        # before vapo-train could hide its loading bars; torchrun's do not: tests/e2e/test_train.py.)
        noise = [line for line in library_noise(stdout).splitlines() if not line.startswith("Loading weights")]
        assert not noise, "\n".join(noise)
    else:
        run_dir = tmp_path / "run"
        stdout = train_in_forks(config, *_overrides(demo_data, run_dir, family), *overrides).stdout
    vapo = [r for r in records(run_dir) if r["phase"] == "vapo"]
    assert len(vapo) == 2, stdout[-3000:]
    roles = ("actor",) if config == "dapo.yaml" else ("actor", "critic")  # GRPO has no critic
    moe = family == "qwen3_moe"
    for r in vapo:
        # Mean |engine - trainer| log-prob over response tokens, float32 on both sides: rounding
        # only (a wrong RoPE scaling, a misrouted token or a misplaced weight gives ~1e-2 and more).
        assert 0.0 <= r["rollout/logprob_diff"] < 1e-6, r["rollout/logprob_diff"]
        assert all(math.isfinite(r[k])
                   for k in ("actor/pg_loss", "actor/grad_norm") + ("critic/value_loss",) * (len(roles) > 1))
        assert ("moe/routing_mismatch" in r) == moe and all((f"{role}/moe_aux_loss" in r) == moe for role in roles)
        if moe:
            # Routing replay is on (a MoE model): the engine's routes reach each trainer router at
            # their tokens through scoring, micro-batches and EP. Both compute in float32, so the
            # routers' own choice agrees with the engine's on (nearly) every token; misplaced routes
            # disagree on most.
            assert 0.0 <= r["moe/routing_mismatch"] < 0.01, r["moe/routing_mismatch"]
            # megatron's aux_loss is E * sum_i f_i * P_i with f_i the fraction of the top-k choices
            # that go to expert i and P_i its mean router probability: 1 for a balanced load, which a
            # random-init router (std 0.02, near-uniform) is close to. A reduction over the wrong
            # ranks (TP shards counted twice, stages or micro-batches not averaged) is off by >= 2x.
            for role in roles:
                assert 0.95 < r[f"{role}/moe_aux_loss"] < 1.5, r[f"{role}/moe_aux_loss"]
    if config == "dapo.yaml":
        assert all(r["rollout/sampling_rounds"] >= 1 for r in vapo) and not any("critic/value_loss" in r for r in vapo)


# ---- an unsupported Llama rope setting: one line, exit 2, from vapo-train, vapo-convert, vapo-plan ----

def _with_rope(src: Path, dst: Path, **change) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], **change}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _error_lines(err: str, prog: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(prog)]


def test_unsupported_rope_is_one_line_from_vapo_train(demo_data, tmp_path):
    bad = _with_rope(demo_data / "llama", tmp_path / "model", high_freq_factor=2.0)
    proc = launch_in_forks("demo_cpu.yaml", [*_overrides(demo_data, tmp_path / "run", "llama"), f"model.hf_path={bad}",
                                             "parallel.tp=1"], nproc=1)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    want = f"{bad / 'config.json'}: rope_parameters.high_freq_factor=2.0 is not supported"
    assert want in proc.stderr and "fixes high_freq_factor=4" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_unsupported_rope_is_one_line_from_vapo_convert(demo_data, tmp_path, capsys):
    from vapo_megatron import convert

    bad = _with_rope(demo_data / "llama", tmp_path / "model", rope_type="yarn")
    assert convert.main(["hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    (line,) = _error_lines(err, "vapo-convert")
    assert "Traceback" not in err and "\n" not in line
    assert f"vapo-convert: error: {bad / 'config.json'}: rope_parameters=" in line
    assert "'rope_type': 'yarn'" in line and "only 'llama3' or the default RoPE" in line
    assert not (tmp_path / "o").exists()


def test_unsupported_rope_is_one_line_from_vapo_plan(demo_data, tmp_path):
    bad = _with_rope(demo_data / "llama", tmp_path / "model", original_max_position_embeddings=4096)
    proc = command_in_forks("vapo_megatron.plan", ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--nodes", "1",
                                                   "--gpus-per-node", "2", f"model.hf_path={bad}"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = _error_lines(proc.stderr, "vapo-plan")
    assert f"{bad / 'config.json'}: rope_parameters.original_max_position_embeddings=4096 is not supported" in line


# ---- a Qwen3-MoE run at EP=2 resumed -------------------------------------------------------------

def test_resume_at_ep2_reaches_the_same_state_and_exports_every_expert(demo_data, moe_ep2_run, tmp_path):
    """Stopped after one step and resumed, a Qwen3-MoE run at EP=2 ends with the same weights AND
    optimizer state (each EP rank's experts and their Adam moments, through megatron's dist
    checkpoint) as the uninterrupted run; its HF export holds every expert of every MoE layer."""
    full_dir, _ = moe_ep2_run
    run_dir = tmp_path / "run"
    overrides = [*_overrides(demo_data, run_dir, "qwen3_moe"), *EP2]
    train_in_forks("demo_cpu.yaml", *overrides, "trainer.total_steps=1")
    proc = train_in_forks("demo_cpu.yaml", *overrides, "trainer.export_hf=true")
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
