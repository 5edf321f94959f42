"""W&B tracking (trainer/wandb_run.py) with the real wandb package, offline: what W&B would sync is
read back from its transaction logs (trainer/wandb_records.py). Never contacts a server. The suite
installs wandb (scripts/setup_env.sh): without it these tests fail rather than skip."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vapo_megatron.config.schema import WandbConfig
from vapo_megatron.trainer import wandb_records
from vapo_megatron.trainer.metrics import MetricsLogger
from vapo_megatron.trainer.wandb_run import ID_FILE, WandbTracker

ROOT = Path(__file__).resolve().parents[2]

@pytest.fixture(autouse=True)
def _wandb_home(tmp_path, monkeypatch):
    """W&B's settings, cache and credentials in the test's directory, never the user's."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    for var in ("WANDB_MODE", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)


def _attempt(run_dir, steps, *, start_step, settings=WandbConfig(mode="offline", tags=("t1",)), config=None):
    """One start of a run: what the trainer does (a tracker, a MetricsLogger), logging `steps`."""
    tracker = WandbTracker.start(settings, str(run_dir), config or {"trainer": {"seed": 1}, "algo": {"gamma": 1.0}})
    logger = MetricsLogger(str(run_dir), total_steps=10, start_step=start_step, sft_start=0, finished=False,
                           enabled=True, tensorboard=False, wandb=tracker)
    for step in steps:
        logger.log(step, "vapo", {"reward/mean": step / 10, "critic/explained_variance": -step})
        if step == 2:  # a second record at the same step (an eval): one W&B row
            logger.log(step, "eval", {"eval/accuracy": 0.5})
    logger.close()
    return tracker


def test_offline_run_holds_every_step_and_the_config_and_a_resume_logs_no_step_twice(tmp_path):
    run_dir = tmp_path / "run"
    first = _attempt(run_dir, [1, 2, 3], start_step=0)
    assert first is not None and first.first_new_step == 0
    rid = (run_dir / ID_FILE).read_text().strip()
    # The checkpoint held step 2: the resume recomputes 3 (W&B holds it) and goes on with 4 and 5.
    second = _attempt(run_dir, [3, 4, 5], start_step=2, config={"trainer": {"seed": 1, "total_steps": 5}})
    assert second.first_new_step == 4
    assert (run_dir / ID_FILE).read_text().strip() == rid
    logs = wandb_records.transaction_logs(run_dir / "wandb", rid)
    assert len(logs) == 2 and all(p.parent.name.startswith("offline-run-") for p in logs)

    rows = wandb_records.history(run_dir / "wandb", rid)
    assert [r["_step"] for r in rows] == [1, 2, 3, 4, 5]  # each step once, in order
    by_step = {r["_step"]: r for r in rows}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        row = by_step[record["step"]]
        for key, value in record.items():
            if key not in ("step", "phase"):
                assert row[key] == pytest.approx(value), (record, row)
    assert by_step[2]["eval/accuracy"] == 0.5 and by_step[2]["reward/mean"] == pytest.approx(0.2)

    config = wandb_records.config(run_dir / "wandb", rid)
    assert config["trainer"] == {"seed": 1, "total_steps": 5}  # the latest start's resolved settings
    assert config["algo"] == {"gamma": 1.0}


def test_turned_on_at_a_resume_w_and_b_gets_the_steps_before_it_from_metrics_jsonl(tmp_path):
    """Steps W&B never wrote (tracking was off, or a killed process had not flushed them) come from
    the records metrics.jsonl keeps, once, before the resumed steps."""
    run_dir = tmp_path / "run"
    assert _attempt(run_dir, [1, 2, 3], start_step=0, settings=WandbConfig()) is None
    tracker = _attempt(run_dir, [3, 4], start_step=2)  # resumed from the checkpoint at step 2
    rows = wandb_records.history(run_dir / "wandb", tracker.run_id)
    assert [r["_step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["eval/accuracy"] == 0.5 and rows[0]["reward/mean"] == pytest.approx(0.1)


def test_disabled_starts_nothing(tmp_path):
    assert WandbTracker.start(WandbConfig(), str(tmp_path), {}) is None
    assert not (tmp_path / ID_FILE).exists() and not (tmp_path / "wandb").exists()


def test_wandb_missing_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    tracker = WandbTracker.start(WandbConfig(mode="offline"), str(tmp_path), {})
    assert tracker is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "wandb package is not installed" in err[0] and "pip install '.[wandb]'" in err[0]
    logger = MetricsLogger(str(tmp_path), total_steps=2, start_step=0, sft_start=0, finished=False, enabled=True,
                           tensorboard=False, wandb=tracker)
    logger.log(1, "vapo", {"reward/mean": 1.0})
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward/mean"] == 1.0


def test_an_unreachable_server_falls_back_to_offline_with_one_warning(tmp_path):
    """In a process of its own: W&B reads WANDB_BASE_URL once per process, at its first start."""
    with socket.socket() as s:  # a local port nobody listens on: the "server" refuses every connection
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {"WANDB_BASE_URL": f"http://127.0.0.1:{port}", "WANDB_API_KEY": "x" * 40, "WANDB_INIT_TIMEOUT": "5",
            "WANDB_CONFIG_DIR": str(tmp_path / "home"), "WANDB_CACHE_DIR": str(tmp_path / "home"),
            "WANDB_DATA_DIR": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    script = ("import sys; from vapo_megatron.config.schema import WandbConfig; "
              "from vapo_megatron.trainer.wandb_run import WandbTracker; "
              "t = WandbTracker.start(WandbConfig(mode='online'), sys.argv[1], {'a': 1}); "
              "t.log(1, {'reward/mean': 0.5}); t.log(2, {'reward/mean': 0.7}); t.finish()")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Said at once, before W&B waits for the server (it once sat silent for WANDB_INIT_TIMEOUT=90 s).
    assert proc.stdout.splitlines()[0] == f"[vapo] W&B: connecting to http://127.0.0.1:{port} (an unreachable " \
        "server: offline after WANDB_INIT_TIMEOUT=5 s)", proc.stdout
    warnings = [ln for ln in proc.stderr.splitlines() if "[vapo] warning" in ln]
    assert (len(warnings) == 1 and "could not start the online run" in warnings[0]
            and "wandb sync" in warnings[0]), proc.stderr
    rid = (tmp_path / "run" / ID_FILE).read_text().strip()
    rows = wandb_records.history(tmp_path / "run" / "wandb", rid)
    assert [(r["_step"], r["reward/mean"]) for r in rows] == [(1, 0.5), (2, 0.7)]
    assert wandb_records.config(tmp_path / "run" / "wandb", rid)["a"] == 1


def test_the_progress_bar_labels_its_figures_and_the_warm_start(tmp_path):
    """It once read 0/N through the whole warm start and showed reward/mean as an unlabeled
    `mean=` (issue 33 item 8)."""
    logger = MetricsLogger(str(tmp_path), total_steps=3, start_step=0, sft_start=0, finished=False, enabled=True,
                           tensorboard=False, sft_steps=40)
    logger.log(0, "sft", {"sft/nll_loss": 0.5, "sft/train_accuracy": 0.25}, tb_step=7)
    assert logger.bar.desc.startswith("warm start 7/40, then RL") and logger.bar.n == 0
    assert logger.bar.postfix == "nll=0.500, train_accuracy=0.250"
    logger.log(1, "vapo", {"reward/mean": -0.5, "critic/explained_variance": 0.125, "actor/lr": 1.0})
    assert logger.bar.desc.startswith("vapo") and logger.bar.n == 1
    assert logger.bar.postfix == "reward=-0.500, explained_variance=0.125"
    logger.close()
