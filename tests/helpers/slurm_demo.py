"""The one-node local Slurm cluster (scripts/slurm_local.sh) and its reference job, shared by
tests/e2e/test_slurm.py and test_slurm_multinode.py (session fixtures, registered in
tests/conftest.py): both files run on one pytest worker, so the shortened demo runs to the end
once, and every interrupted job of either file must end with its weights.

Job state comes from `scontrol show job` (no accounting daemon here).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.slurm_cluster import CANNOT_RUN, FINAL_STATES, JOB_POLL, wait_for
from tests.helpers.train_runs import make_demo_data

REPO = Path(__file__).resolve().parents[2]
SLURM_LOCAL = REPO / "scripts" / "slurm_local.sh"
TRAIN_SBATCH = REPO / "slurm" / "vapo_train.sbatch"
DEMO_CONFIG = REPO / "configs" / "demo_cpu.yaml"

# 1 value-pretraining iteration + VAPO_STEPS VAPO iterations; each takes about a second of CPU for
# the two ranks here (one optimizer update each for actor and critic), so a dozen leave several
# seconds in which to stop a job mid-run, and room for the two-node job's two stops and resumes.
VAPO_STEPS = 12
FINAL_ITER = 1 + VAPO_STEPS
SAVE_EVERY = 5


@pytest.fixture(scope="session")
def slurm_env(slurm_lock) -> dict[str, str]:
    """Environment whose SLURM_CONF points at the local cluster; stops the daemons it started."""
    conf = subprocess.run(["bash", str(SLURM_LOCAL), "env"], capture_output=True, text=True, check=True).stdout
    env = dict(os.environ, SLURM_CONF=conf.strip().removeprefix("export SLURM_CONF="))
    was_running = subprocess.run(["bash", str(SLURM_LOCAL), "status"], capture_output=True, env=env).returncode == 0
    start = subprocess.run(["bash", str(SLURM_LOCAL), "start"], capture_output=True, text=True, env=env)
    if start.returncode == CANNOT_RUN:
        pytest.skip(f"no Slurm cluster possible here: {start.stderr.strip()}")
    assert start.returncode == 0, f"scripts/slurm_local.sh start failed:\n{start.stdout}\n{start.stderr}"
    yield env
    if not was_running:  # leave a cluster someone else started alone
        subprocess.run(["bash", str(SLURM_LOCAL), "stop"], check=True, env=env)


def job_fields(job_id: str, env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env,
                         check=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def wait_done(job_id: str, env: dict[str, str], timeout: float) -> dict[str, str]:
    return wait_for(lambda: (f := job_fields(job_id, env))["JobState"] in FINAL_STATES and f, timeout,
                    f"job {job_id} to end", poll=JOB_POLL)


def sbatch(script: Path, args: list[str], env: dict[str, str], log: Path, extra_env: dict[str, str],
           flags: tuple[str, ...] = ()) -> str:
    """Submits on 1 CPU node (no GPUs); returns the job id."""
    job_env = dict(env, VAPO_PYTHON=sys.executable, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra_env)
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--output={log}", *flags, str(script), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=job_env, cwd=REPO)
    assert out.returncode == 0, f"sbatch failed: {out.stderr}"
    return out.stdout.strip().split(";")[0]


def submit_train(run_dir: Path, log: Path, env: dict[str, str], args: list[str], flags: tuple[str, ...] = ()) -> str:
    """The documented command line: the run dir as the last override."""
    return sbatch(TRAIN_SBATCH, [*args, f"trainer.run_dir={run_dir}"], env, log, {"GPUS_PER_NODE": "2"}, flags)


@pytest.fixture(scope="session")
def slurm_demo_data(tmp_path_factory) -> Path:
    return make_demo_data(tmp_path_factory.mktemp("slurm_demo") / "data", n_train=128, n_eval=8, n_sft=32)


def short_demo(data: Path) -> list[str]:
    """Overrides that shrink configs/demo_cpu.yaml to a run of a few seconds. No warm start (SFT:
    its greedy checks cost more CPU than the whole RL part; resuming past it is tested in
    tests/e2e/test_train.py) and one optimizer update per step (algo.mini_batches=1): what these
    jobs test is the launch, the stops, the requeues and the resumes, whatever the steps compute."""
    return [
        f"model.hf_path={data}/model", f"data.train_files=[{data}/train.jsonl]", f"data.eval_files=[{data}/eval.jsonl]",
        f"sft.files=[{data}/sft.jsonl]", "sft.steps=0", "algo.value_pretrain_steps=1", "algo.mini_batches=1",
        "rollout.prompts_per_step=8", "rollout.n_samples=4", "eval.max_prompts=4", f"trainer.save_every={SAVE_EVERY}",
        "eval.every=100", "trainer.tensorboard=false", f"trainer.total_steps={VAPO_STEPS}",
    ]


@pytest.fixture(scope="session")
def uninterrupted(slurm_env, slurm_demo_data, tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """The reference job: the shortened demo from start to end (TP=2: two workers on one node).
    The run dir has a space in its name, to show that arguments reach the trainer intact."""
    base = tmp_path_factory.mktemp("uninterrupted")
    run_dir, log = base / "run A", base / "job.out"
    job_id = submit_train(run_dir, log, slurm_env, [str(DEMO_CONFIG), *short_demo(slurm_demo_data)])
    return run_dir, log, wait_done(job_id, slurm_env, timeout=240)
