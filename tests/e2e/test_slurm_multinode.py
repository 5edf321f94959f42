"""slurm/vapo_train.sbatch across two Slurm nodes, each in its own network namespace.

scripts/slurm_local.sh with VAPO_SLURM_NODES=2 starts a cluster whose nodes look like two hosts:
their own hostname, address (10.213.0.11, .12), slurmd, and /etc/hosts naming both; the run
directory is on the filesystem they share. The job is the same sbatch script users submit,
unchanged: one srun task per node, torchrun on each with one CPU worker, the trainer with TP=2
across the two nodes (configs/demo_cpu.yaml, shortened as in tests/test_slurm.py).

The reference is a one-node job of the same layout, data and seed: tests/e2e/test_slurm.py's
uninterrupted job (two workers on the one-node cluster; a session fixture, tests/helpers/slurm_demo.py).
Every two-node run must end with bitwise its actor and critic. Two jobs: one stopped twice by SIGUSR1
mid-run, requeued and resumed each time (first only the second node's step gets the signal, then
every process of the job, as `--signal=USR1@T` sends it), then run to the end; and one failed by a
worker killed with SIGKILL, then resubmitted. The first job's final checkpoint is also the one the
conversion job exports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.slurm_cluster import REPO, Cluster, start_cluster, stop_cluster, wait_for
from tests.helpers.slurm_demo import DEMO_CONFIG, FINAL_ITER, SAVE_EVERY, short_demo
from tests.helpers.train_runs import checkpoint_tensors, hf_weights, records

TRAIN_SBATCH = REPO / "slurm" / "vapo_train.sbatch"
CONVERT_SBATCH = REPO / "slurm" / "convert.sbatch"
REQUEUE_EXIT = 75  # vapo_train.sbatch's per-node exit code asking for a requeue
JOB_TIMEOUT = 600  # seconds, against hangs only: a job takes about 1 minute alone here, 2 to 6 on a loaded machine


@pytest.fixture(scope="module")
def cluster(slurm_lock) -> Cluster:
    cluster, started = start_cluster(nodes=2)
    if cluster is None:
        pytest.skip(f"no two-node Slurm cluster possible here: {started}")
    yield cluster
    if started:  # leave a cluster someone else started alone
        stop_cluster(cluster)


@pytest.fixture(scope="module")
def demo_data(slurm_demo_data) -> Path:
    return slurm_demo_data  # the reference job's data


def demo_args(data: Path) -> list[str]:
    return [str(DEMO_CONFIG), *short_demo(data)]


def submit(cluster: Cluster, script: Path, args: list[str], log: Path, *, nodes: int, workers: int,
           run_dir: Path | None = None) -> str:
    """sbatch on CPU nodes (no GPUs), `workers` per node; returns the job id."""
    env = dict(cluster.env, VAPO_PYTHON=sys.executable, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               GPUS_PER_NODE=str(workers))
    if run_dir is not None:  # as users submit it: the last override names the run dir
        args = [*args, f"trainer.run_dir={run_dir}"]
    out = cluster.run("sbatch", "--parsable", f"--nodes={nodes}", "--gpus-per-node=0", f"--output={log}",
                      str(script), *args, env=env, cwd=REPO)
    return out.stdout.strip().split(";")[0]


def train(cluster, data, run_dir: Path, log: Path, nodes: int) -> str:
    # TP=2 either way: two workers on one node, or one on each of two nodes
    return submit(cluster, TRAIN_SBATCH, demo_args(data), log, nodes=nodes, workers=2 // nodes, run_dir=run_dir)


def final_checkpoint(run_dir: Path) -> Path:
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"iter_{FINAL_ITER:07d}"
    return run_dir / "checkpoints" / f"iter_{FINAL_ITER:07d}"


def assert_same_weights(ref_dir: Path, run_dir: Path) -> None:
    """Actor and critic (weights and optimizer state) bitwise equal at the final iteration."""
    for model in ("actor", "critic"):
        want = checkpoint_tensors(final_checkpoint(ref_dir) / model)
        have = checkpoint_tensors(final_checkpoint(run_dir) / model)
        assert want.keys() == have.keys()
        differ = {k: float((want[k] - have[k]).abs().max()) for k in want if not torch.equal(want[k], have[k])}
        assert not differ, f"{model}: tensors differ from the one-node run (max abs difference): {differ}"


def logged_once(run_dir: Path) -> None:
    steps = [r["step"] for r in records(run_dir) if r["phase"] in ("value_pretrain", "vapo")]
    assert steps == list(range(1, FINAL_ITER + 1))


def completed(fields: dict[str, str], log: Path, restarts: int = 0) -> str:
    text = log.read_text(errors="replace")
    assert ((fields["JobState"], fields["ExitCode"], fields["Restarts"])
            == ("COMPLETED", "0:0", str(restarts))), text[-4000:]
    return text


@pytest.fixture(scope="module")
def one_node(uninterrupted) -> Path:
    """The reference: the same layout (TP=2) and seed as two workers on one node."""
    run_dir, log, fields = uninterrupted
    completed(fields, log)
    return run_dir


def last_step(run_dir: Path) -> int:
    """The newest iteration in the run's metrics (0 before the first); a line being written is skipped."""
    path, last = run_dir / "metrics.jsonl", 0
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("phase") in ("value_pretrain", "vapo"):
            last = max(last, record["step"])
    return last


STOPPED = r"stop \(SIGUSR1\): checkpoint at iteration (\d+)"
RESUMED = r"resumed from .+ at iteration (\d+)"


@pytest.fixture(scope="module")
def two_nodes(cluster, demo_data, tmp_path_factory) -> tuple[Path, str, dict[str, str], list[str]]:
    """The two-node job, stopped by SIGUSR1 twice. Restart 0: only the second node's step processes
    get it (a signal lost or late on the others: the trainer's ranks agree on the stop all the same,
    and that one node's request requeues the job). Restart 1: every process of the job's steps on
    both nodes gets it, as Slurm sends it at `--signal=USR1@T` (no B:). Restart 2 runs to the end.
    Each signal comes after an iteration of the restart it stops: the trainer's handlers are in place."""
    base = tmp_path_factory.mktemp("two_nodes")
    run_dir, log = base / "run", base / "job.out"
    job = train(cluster, demo_data, run_dir, log, nodes=2)
    wait_for(lambda: last_step(run_dir) >= 1, JOB_TIMEOUT, "the first training iteration", poll=0.05)
    nodes = node_names(cluster, cluster.job_fields(job))
    for pid in step_pids(nodes[1], job):
        os.kill(pid, signal.SIGUSR1)
    first = int(wait_for(lambda: re.search(STOPPED, log.read_text(errors="replace")), JOB_TIMEOUT,
                         "the first stop")[1])
    wait_for(lambda: last_step(run_dir) > first, 2 * JOB_TIMEOUT, "an iteration of the requeued job", poll=0.05)
    cluster.run("scancel", "--signal=USR1", job)
    fields = cluster.wait_done(job, 2 * JOB_TIMEOUT)
    return run_dir, completed(fields, log, restarts=2), fields, nodes


def node_names(cluster: Cluster, fields: dict[str, str]) -> list[str]:
    return cluster.run("scontrol", "show", "hostnames", fields["NodeList"]).stdout.split()


def restart_output(text: str, restart: int) -> str:
    """The part of the job's log that restart `restart` wrote (the log is appended to)."""
    parts = re.split(r"^vapo_train\.sbatch: job \d+ restart (\d+) on", text, flags=re.M)
    starts = [int(n) for n in parts[1::2]]
    assert starts == list(range(len(starts))), text[-4000:]
    return parts[2 + 2 * restart]


def test_two_node_job_equals_the_one_node_run(two_nodes, one_node, cluster):
    run_dir, text, fields, nodes = two_nodes
    assert len(nodes) == 2 and text.count("(2 nodes x 1 workers)") == 3, text[-4000:]
    # The rendezvous is the first node's own address (its NodeAddr), not this machine's or a name.
    head_addr = re.search(r"NodeAddr=(\S+)", cluster.run("scontrol", "show", "node", "-o", nodes[0]).stdout)[1]
    assert text.count(f"rendezvous {head_addr}:") == 3, text[-4000:]
    assert not head_addr.startswith("127."), head_addr
    assert json.loads((final_checkpoint(run_dir) / "state.json").read_text())["world_size"] == 2
    # Two stops, one checkpoint each (written collectively), each resumed from by the next restart.
    stopped, resumed = re.findall(STOPPED, text), re.findall(RESUMED, text)
    assert len(stopped) == 2 and resumed == stopped, text[-4000:]
    assert 1 <= int(stopped[0]) < int(stopped[1]) < FINAL_ITER, text[-4000:]
    assert_same_weights(one_node, run_dir)
    want, have = hf_weights(one_node / "hf"), hf_weights(run_dir / "hf")
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
    logged_once(run_dir)


def step_pids(node: str, job_id: str) -> list[int]:
    """Every process of the job's step 0 on `node` (the processes in the node's network namespace,
    which has the node's name, whose environment names the job and the step)."""
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, check=True).stdout.split()
    found = []
    for pid in pids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ and b"SLURM_STEP_ID=0" in environ:
            found.append(int(pid))
    return found


@pytest.mark.parametrize("to", ["second node", "job"])
def test_usr1_checkpoints_on_every_node_requeues_and_resumes(to, two_nodes):
    """The restart that `to` stopped (two_nodes: restart 0 by the second node's signal, restart 1 by
    the job's): the nodes that got SIGUSR1 say so and no other does, the trainer stopped all ranks at
    one step with one checkpoint, the job requeued itself, and the next restart resumed from that
    checkpoint on two nodes."""
    _, text, _, nodes = two_nodes
    restart, signalled = (0, nodes[1:]) if to == "second node" else (1, nodes)
    out, after = restart_output(text, restart), restart_output(text, restart + 1)
    for node in nodes:
        assert (f"node {node}: SIGUSR1 received" in out) == (node in signalled), out[-4000:]
    stopped = re.findall(STOPPED, out)
    assert len(stopped) == 1 and "asking for a requeue" in out and "requeueing job" in out, out[-4000:]
    assert re.findall(RESUMED, after) == stopped and "(2 nodes x 1 workers)" in after, after[-4000:]


def worker_pid(node: str) -> int | None:
    """The trainer worker (`python -m vapo_megatron.train`, not torchrun) running on `node`: the
    processes in the node's network namespace, which has the node's name."""
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, check=True).stdout.split()
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"vapo_megatron.train"]:
            return int(pid)
    return None


def test_a_killed_worker_fails_the_job_promptly_and_a_resubmission_resumes(cluster, demo_data, one_node, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job = train(cluster, demo_data, run_dir, log, nodes=2)
    latest = run_dir / "checkpoints" / "latest"
    wait_for(latest.exists, JOB_TIMEOUT, "the first periodic checkpoint", poll=0.05)
    nodes = node_names(cluster, cluster.job_fields(job))
    pid = wait_for(lambda: worker_pid(nodes[1]), 30, f"the trainer worker on {nodes[1]}")
    os.kill(pid, signal.SIGKILL)
    # torchrun on the second node reports its worker's death and exits 1; srun (--kill-on-bad-exit=1)
    # then ends the first node's task, whose worker would otherwise wait in a collective for the
    # process-group timeout (30 min). The bound here is the job's, far below that.
    fields = cluster.wait_done(job, 120)
    text = log.read_text(errors="replace")
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "1:0", "0"), text[-4000:]
    # The job's exit code is the failed node's (torchrun: 1), not srun's (137, from the node it killed).
    assert f"node {nodes[1]} failed first (torchrun exited with 1)" in text, text[-4000:]
    assert re.search(rf"srun: error: {nodes[1]}: task 1: Exited with exit code 1", text), text[-4000:]
    saved = int(latest.read_text().strip().removeprefix("iter_"))
    assert saved % SAVE_EVERY == 0 and saved < FINAL_ITER

    # The same command again (same run dir) resumes from the last checkpoint and ends like the rest.
    log2 = tmp_path / "job2.out"
    job2 = train(cluster, demo_data, run_dir, log2, nodes=2)
    text2 = completed(cluster.wait_done(job2, JOB_TIMEOUT), log2)
    assert re.findall(r"resumed from .+ at iteration (\d+)", text2) == [str(saved)], text2[-4000:]
    assert_same_weights(one_node, run_dir)
    logged_once(run_dir)


def test_convert_job_exports_a_two_node_checkpoint(two_nodes, cluster, tmp_path):
    """The actor checkpoint the two nodes wrote, exported by convert.sbatch with two workers (TP=2)
    on one node, equals the trainer's own HF export of the same weights."""
    run_dir = two_nodes[0]
    out, log = tmp_path / "actor hf", tmp_path / "convert.out"
    args = ["mcore-to-hf", "--ckpt", str(final_checkpoint(run_dir) / "actor"), "--out", str(out), "--tp", "2"]
    job = submit(cluster, CONVERT_SBATCH, args, log, nodes=1, workers=2)
    fields = cluster.wait_done(job, JOB_TIMEOUT)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log.read_text(errors="replace")[-4000:]
    want, have = hf_weights(run_dir / "hf"), hf_weights(out)
    assert want.keys() == have.keys()
    assert all(torch.equal(want[k], have[k]) for k in want), [k for k in want if not torch.equal(want[k], have[k])]
