"""slurm/vapo_train.sbatch on a real one-node Slurm cluster (scripts/slurm_local.sh), CPU ranks.

The training entry point is replaced by tests/slurm_standin.py (VAPO_ENTRY): 2 gloo ranks under
torchrun that all-reduce, honour SIGUSR1 like the trainer (checkpoint marker, exit) and resume from
the marker. Job state comes from `scontrol show job` (no accounting daemon here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SLURM_LOCAL = REPO / "scripts" / "slurm_local.sh"
TRAIN_SBATCH = REPO / "slurm" / "vapo_train.sbatch"
STANDIN = REPO / "tests" / "slurm_standin.py"
CANNOT_INSTALL = 3  # slurm_local.sh's exit code when Slurm cannot be installed or run here
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """Environment whose SLURM_CONF points at the local cluster; stops the daemons it started."""
    conf = subprocess.run(["bash", str(SLURM_LOCAL), "env"], capture_output=True, text=True, check=True).stdout
    env = dict(os.environ, SLURM_CONF=conf.strip().removeprefix("export SLURM_CONF="))
    was_running = subprocess.run(["bash", str(SLURM_LOCAL), "status"], capture_output=True, env=env).returncode == 0
    start = subprocess.run(["bash", str(SLURM_LOCAL), "start"], capture_output=True, text=True, env=env)
    if start.returncode == CANNOT_INSTALL:
        pytest.skip(f"no Slurm cluster possible here: {start.stderr.strip()}")
    assert start.returncode == 0, f"scripts/slurm_local.sh start failed:\n{start.stdout}\n{start.stderr}"
    yield env
    if not was_running:  # leave a cluster someone else started alone
        subprocess.run(["bash", str(SLURM_LOCAL), "stop"], check=True, env=env)


def job_fields(job_id: str, env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env, check=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_done(job_id: str, env: dict[str, str], timeout: float) -> dict[str, str]:
    fields = wait_for(lambda: (f := job_fields(job_id, env))["JobState"] in FINAL_STATES and f, timeout, f"job {job_id} to end")
    return fields


def submit(tmp_path: Path, env: dict[str, str], args: list[str]) -> tuple[str, Path, Path]:
    """sbatch slurm/vapo_train.sbatch with 2 CPU workers on 1 node; returns (job id, run dir, log)."""
    run_dir = tmp_path / "run"
    log = tmp_path / "job.out"
    job_env = dict(
        env, GPUS_PER_NODE="2", VAPO_PYTHON=sys.executable, VAPO_ENTRY=f"{sys.executable} {STANDIN}",
        VAPO_RUN_DIR=str(run_dir), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
    )
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--output={log}", str(TRAIN_SBATCH), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=job_env, cwd=REPO)
    assert out.returncode == 0, f"sbatch failed: {out.stderr}"
    return out.stdout.strip().split(";")[0], run_dir, log


def write_config(tmp_path: Path) -> Path:
    config = tmp_path / "tiny.yaml"
    config.write_text("model:\n  preset: tiny\n")
    return config


def test_train_job_completes_and_passes_arguments(slurm_env, tmp_path):
    config = write_config(tmp_path)
    job_id, run_dir, log = submit(tmp_path, slurm_env, [str(config), "standin.steps=3", "standin.pause_at=-1", "x.y=a b"])
    fields = wait_done(job_id, slurm_env, timeout=60)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log.read_text()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == 2
    assert result["steps"] == 3 and result["resumed_from"] == 0
    assert result["mean_step_sum"] == 1 + 2  # all-reduce of rank + 1 over 2 ranks
    assert result["config"] == str(config)
    # extra key=value arguments pass through verbatim (one with a space), then the run dir
    assert result["overrides"] == {"standin.steps": "3", "standin.pause_at": "-1", "x.y": "a b", "trainer.run_dir": str(run_dir)}


def test_usr1_checkpoints_requeues_and_resumes(slurm_env, tmp_path):
    config = write_config(tmp_path)
    job_id, run_dir, log = submit(tmp_path, slurm_env, [str(config), "standin.steps=6", "standin.pause_at=2"])
    wait_for(lambda: all((run_dir / f"holding.rank{r}").exists() for r in range(2)), 60, "both ranks to hold at step 2")
    # What Slurm does at `--signal=USR1@T` (no B:): SIGUSR1 to every process of the job steps.
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True, env=slurm_env)
    fields = wait_done(job_id, slurm_env, timeout=90)
    text = log.read_text()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    # every worker saw the signal itself: torchrun survived it and kept its workers alive
    assert all((run_dir / f"signalled.rank{r}").exists() for r in range(2)), sorted(os.listdir(run_dir))
    assert json.loads((run_dir / "checkpoint.json").read_text()) == {"next_step": 2}
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["resumed_from"], result["steps"], result["restart_count"]) == (2, 6, 1)
    assert "asking for a requeue" in text and "restart 1" in text, text


def test_missing_config_fails_with_a_clear_message(slurm_env, tmp_path):
    job_id, _, log = submit(tmp_path, slurm_env, [str(tmp_path / "nope.yaml")])
    fields = wait_done(job_id, slurm_env, timeout=30)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0")
    assert f"config file '{tmp_path / 'nope.yaml'}' not found" in log.read_text()
