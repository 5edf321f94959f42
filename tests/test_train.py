"""The trainer end to end through its real entry point: torchrun, 2 ranks, TP=2, the embedded
engine, a shortened demo config. Also: exact resume, and the vanilla-PPO config."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]

REQUIRED_METRICS = [
    "step", "phase", "reward/mean", "reward/accuracy", "response_length/mean", "response_length/max",
    "actor/pg_loss", "actor/nll_loss", "actor/clipfrac", "actor/entropy", "actor/grad_norm",
    "critic/value_loss", "critic/explained_variance", "rollout/logprob_diff", "perf/step_s",
    "perf/tokens_per_s", "perf/padding_ratio",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "data"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_demo_data.py"), "--out", str(out),
         "--n-train", "256", "--n-eval", "32", "--n-sft", "128"],
        check=True, cwd=ROOT, capture_output=True,
    )
    return out


def _short(data: Path, run_dir: Path) -> list[str]:
    return [
        f"trainer.run_dir={run_dir}", f"model.hf_path={data}/model",
        f"data.train_files=[{data}/train.jsonl]", f"data.eval_files=[{data}/eval.jsonl]",
        f"sft.files=[{data}/sft.jsonl]", "sft.steps=4", "sft.batch_size=16",
        "algo.value_pretrain_steps=1", "rollout.prompts_per_step=8", "rollout.n_samples=4",
        "data.eval_max_prompts=16", "trainer.save_every=2", "trainer.eval_every=2",
        "trainer.tensorboard=false",
    ]


def _train(config: str, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "vapo_megatron.train", "--config", str(ROOT / "configs" / config), *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"vapo-train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a sharded HF safetensors export (through its index)."""
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(hf_dir / shard)))
    assert out.keys() == index["weight_map"].keys()
    return out


def _exported(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    """A trainer checkpoint's weights, through `vapo-convert mcore-to-hf` (one process)."""
    if not out.exists():
        subprocess.run([sys.executable, "-m", "vapo_megatron.convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out)],
                       check=True, cwd=ROOT, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return hf_weights(out)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def full_run(demo_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("full") / "run"
    _train("demo_cpu.yaml", *_short(demo_data, run_dir), "trainer.total_steps=3")
    return run_dir


def test_demo_config_runs_end_to_end(full_run):
    records = _records(full_run)
    phases = [r["phase"] for r in records]
    assert phases.count("sft") == 4 and phases.count("value_pretrain") == 1 and phases.count("vapo") == 3
    for r in records:
        if r["phase"] == "vapo":
            missing = [k for k in REQUIRED_METRICS if k not in r]
            assert not missing, f"step {r['step']} lacks {missing}"
    evals = [r for r in records if r["phase"] == "eval"]
    assert len(evals) >= 2 and all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)
    assert (full_run / "checkpoints" / "latest").read_text().strip() == "iter_0000004"
    # The final HF export loads in transformers and generates.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(full_run / "hf")
    model = AutoModelForCausalLM.from_pretrained(full_run / "hf")
    ids = tok.apply_chat_template([{"role": "user", "content": "12+34="}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    # The plot script reads the run.
    subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_metrics.py"), str(full_run)], check=True, capture_output=True)
    assert (full_run / "curves.png").stat().st_size > 10_000


def test_restart_after_checkpoint_reaches_same_weights(full_run, demo_data, tmp_path):
    run_dir = tmp_path / "run"
    _train("demo_cpu.yaml", *_short(demo_data, run_dir), "trainer.total_steps=1")   # stops at iteration 2
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    proc = _train("demo_cpu.yaml", *_short(demo_data, run_dir), "trainer.total_steps=3")
    assert "resumed from" in proc.stdout + proc.stderr
    for role in ("actor", "critic"):
        want = _exported(full_run / "checkpoints" / "iter_0000004" / role, tmp_path / f"want_{role}")
        have = _exported(run_dir / "checkpoints" / "iter_0000004" / role, tmp_path / f"have_{role}")
        assert want.keys() == have.keys()
        for name in want:
            assert torch.equal(want[name], have[name]), f"{role} {name} differs after resume"
    # The run's own final HF export is the actor of its last checkpoint.
    final = hf_weights(run_dir / "hf")
    actor = _exported(run_dir / "checkpoints" / "iter_0000004" / "actor", tmp_path / "have_actor")
    assert all(torch.equal(final[k], actor[k]) for k in actor) and final.keys() == actor.keys()
    # The metrics of the redone steps are not duplicated.
    steps = [r["step"] for r in _records(run_dir) if r["phase"] == "vapo"]
    assert steps == sorted(set(steps))


def test_vanilla_ppo_config_runs(demo_data, tmp_path):
    run_dir = tmp_path / "vanilla"
    _train("vanilla_ppo.yaml", *_short(demo_data, run_dir), "trainer.total_steps=2", "rollout.prompts_per_step=32",
           "rollout.n_samples=1", "algo.value_pretrain_steps=0")
    records = [r for r in _records(run_dir) if r["phase"] == "vapo"]
    assert len(records) == 2 and all("actor/pg_loss" in r for r in records)
