"""trainer.wandb.mode=offline on a real vapo-train run that is killed and resumed: the W&B offline
run holds every step's metrics and the resolved configuration, the resume continues the same run
id, and no step is logged twice (trainer/wandb_run.py). What W&B would sync is read back from its
transaction logs (trainer/wandb_records.py); nothing contacts a server.

vapo-train's main on one rank (TP=1) forked from the suite's preloaded forkserver on the tiny demo
model, as tests/e2e/test_records_once.py (tests/helpers/train_runs.py launch_in_forks); the crash is
the test-only fault injection (VAPO_FAULT, tests/helpers/faults.py), a SIGKILL of the rank in the
middle of iteration 3."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.helpers.train_runs import Launch, launch_in_forks
from vapo_megatron.trainer import wandb_records
from vapo_megatron.trainer.wandb_run import ID_FILE


@pytest.fixture(autouse=True)
def _no_wandb_env(monkeypatch):
    """The forked rank's environment is this process's: no W&B setting of the user's in it."""
    for name in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(name)


def _cli(demo: Path, run_dir: Path, home: Path, *, fault: str = "") -> Launch:
    env = {"WANDB_CONFIG_DIR": str(home), "WANDB_CACHE_DIR": str(home), "WANDB_DATA_DIR": str(home)}
    # A fault needs the tests' entry point (vapo-train with the fault hook installed).
    module = "tests.helpers.faults" if fault else "vapo_megatron.train"
    args = [f"trainer.run_dir={run_dir}", f"model.hf_path={demo}/model", f"data.train_files=[{demo}/train.jsonl]",
            f"data.eval_files=[{demo}/eval.jsonl]", "eval.n_samples=2", "eval.every=2",
            f"sft.files=[{demo}/sft.jsonl]", "sft.steps=2", "sft.batch_size=4", "sft.eval_every=100",
            "parallel.tp=1", "algo.value_pretrain_steps=0", "algo.mini_batches=1", "rollout.prompts_per_step=4",
            "rollout.n_samples=2", "rollout.max_new_tokens=4", "trainer.total_steps=5", "trainer.save_every=2",
            "trainer.tensorboard=false", "trainer.export_hf=false", "trainer.wandb.mode=offline",
            "trainer.wandb.tags=[ci,offline]"]
    return launch_in_forks("demo_cpu.yaml", args, env=env | ({"VAPO_FAULT": fault} if fault else {}), nproc=1,
                           module=module)


def test_an_offline_run_killed_and_resumed_holds_every_step_once_in_one_wandb_run(demo, tmp_path):
    run_dir, home = tmp_path / "run", tmp_path / "wandb-home"
    # Killed during iteration 3 (after steps 1-3 were logged); the checkpoint is at step 2.
    crashed = _cli(demo, run_dir, home, fault="rollout@3")
    assert crashed.returncode != 0 and "VAPO_FAULT: killing" in crashed.stdout, crashed.stderr[-3000:]
    rid = (run_dir / ID_FILE).read_text().strip()
    assert f"[vapo] W&B run {rid}: offline" in crashed.stdout

    resumed = _cli(demo, run_dir, home)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert (run_dir / ID_FILE).read_text().strip() == rid  # the same W&B run, not a new one
    logs = wandb_records.transaction_logs(run_dir / "wandb", rid)
    assert len(logs) == 2, logs  # one per start, both of run `rid`

    rows = wandb_records.history(run_dir / "wandb", rid)
    steps = [r["_step"] for r in rows]
    assert steps == sorted(set(steps)), f"a step logged twice or out of order: {steps}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in records}) == steps == [0, 1, 2, 3, 4, 5]
    by_step = {r["_step"]: r for r in rows}
    for record in records:
        row = by_step[record["step"]]
        missing = [k for k in record if k not in ("step", "phase", "sft_step") and k not in row]
        assert not missing, f"step {record['step']} ({record['phase']}): {missing} not in W&B"
        if record["phase"] in ("vapo", "eval"):  # SFT records share step 0: W&B keeps their last values
            for key, value in record.items():
                if key.startswith(("reward/", "eval/", "response_length/")):
                    assert row[key] == pytest.approx(value, nan_ok=True), (key, record["step"])

    # The run's config is the resolved configuration (run_dir/config.yaml, every key).
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    config = wandb_records.config(run_dir / "wandb", rid)
    assert {k: config[k] for k in saved} == saved
    assert config["trainer"]["wandb"]["tags"] == ["ci", "offline"]
