"""A local Slurm cluster for the tests (scripts/slurm_local.sh) and the job helpers they share.

One node, or several in their own network namespaces (VAPO_SLURM_NODES). Client commands go
through `slurm_local.sh exec`, which runs them where the controller can be reached. Job state comes
from `scontrol show job` (no accounting daemon here).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLURM_LOCAL = REPO / "scripts" / "slurm_local.sh"
CANNOT_RUN = 3  # slurm_local.sh's exit code when no cluster can be installed or started here
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# Held while a test session has a local cluster: two pytest runs on one machine would otherwise
# start, share and stop the same daemons (and munged) under each other's jobs.
LOCK_FILE = "/tmp/vapo-slurm.lock"
# Seconds between two `scontrol show job` of a job awaited to its end: each costs ~17 ms of CPU
# (bash, ip netns exec, scontrol and slurmctld's answer), and the jobs take minutes.
JOB_POLL = 1.0


@dataclass
class Cluster:
    nodes: int
    env: dict[str, str]  # SLURM_CONF and VAPO_SLURM_NODES: what slurm_local.sh and the clients need

    def run(self, *cmd: str, env: dict[str, str] | None = None, check: bool = True, cwd: Path | None = None):
        """A client command (sbatch, scontrol, scancel...) on this cluster."""
        out = subprocess.run(["bash", str(SLURM_LOCAL), "exec", *cmd], capture_output=True, text=True,
                             env=env or self.env, cwd=cwd)
        if check:
            assert out.returncode == 0, f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr}"
        return out

    def job_fields(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait_done(self, job_id: str, timeout: float) -> dict[str, str]:
        return wait_for(lambda: (f := self.job_fields(job_id))["JobState"] in FINAL_STATES and f, timeout,
                        f"job {job_id} to end", poll=JOB_POLL)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def session_lock():
    """Takes LOCK_FILE (blocking); returns the open file, whose closing releases it."""
    f = open(LOCK_FILE, "a")
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def start_cluster(nodes: int):
    """Starts (or joins) the cluster. Returns (cluster, started_here), or (None, reason) when Slurm
    cannot run on this machine."""
    env = dict(os.environ, VAPO_SLURM_NODES=str(nodes))
    conf = subprocess.run(["bash", str(SLURM_LOCAL), "env"], capture_output=True, text=True, env=env, check=True).stdout
    env["SLURM_CONF"] = conf.strip().removeprefix("export SLURM_CONF=")
    was_running = subprocess.run(["bash", str(SLURM_LOCAL), "status"], capture_output=True, env=env).returncode == 0
    start = subprocess.run(["bash", str(SLURM_LOCAL), "start"], capture_output=True, text=True, env=env)
    if start.returncode == CANNOT_RUN:
        return None, start.stderr.strip()
    assert start.returncode == 0, f"scripts/slurm_local.sh start failed:\n{start.stdout}\n{start.stderr}"
    return Cluster(nodes, env), not was_running


def stop_cluster(cluster: Cluster) -> None:
    subprocess.run(["bash", str(SLURM_LOCAL), "stop"], check=True, env=cluster.env)
