"""SIGUSR1 sent to every process of a trainer, as Slurm does: the trainer records it and its helper
processes live on (vapo_megatron/stop_signals.py). The helper here is the kind megatron starts for
checkpoint writing: a multiprocessing Manager spawned after the signal handling is in place."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, multiprocessing as mp, sys, time
from vapo_megatron.trainer.signals import StopSignals

if __name__ == "__main__":
    stop = StopSignals().install()
    manager = mp.get_context("spawn").Manager()  # started after install(), like megatron's writer
    queue = manager.Queue()
    print("ready", flush=True)
    deadline = time.monotonic() + 20
    while stop.signum == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # a helper killed by the signal is gone by now
    try:
        queue.put("still answering")
        reply = queue.get(timeout=5)
    except Exception as e:  # the manager died: BrokenPipeError / ConnectionRefusedError / EOFError
        reply = type(e).__name__
    print(json.dumps({"signum": stop.signum, "helper": reply}), flush=True)
"""


def test_sigusr1_to_the_whole_process_group_stops_the_trainer_and_spares_its_helpers(tmp_path):
    script = tmp_path / "trainer_like.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGUSR1)  # the trainer and every process it started
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"signum": int(signal.SIGUSR1), "helper": "still answering"}


def test_sigusr1_during_the_final_step_finishes_the_run_without_a_requeue(tmp_path):
    """The signal that Slurm sends before the time limit, arriving during the last step (test-only
    fault point usr1, tests/helpers/faults.py: each rank sends it to itself): the run does its final
    save and export and exits 0, and does not ask the launcher for a requeue (which would redo them).
    Its 2 ranks are forked from the suite's preloaded forkserver (tests/helpers/train_runs.py
    launch_in_forks): the signal is to the rank's own process, not to a launcher."""
    from tests.helpers import faults
    from tests.helpers.train_runs import make_demo_data, train_in_forks

    data = make_demo_data(tmp_path / "data", n_train=16, n_eval=4, n_sft=4)
    run_dir, marker = tmp_path / "run", tmp_path / "requeue"
    run = train_in_forks(
        "demo_cpu.yaml", f"trainer.run_dir={run_dir}", f"model.hf_path={data}/model",
        f"data.train_files=[{data}/train.jsonl]", "data.eval_files=[]", "sft.files=[]", "sft.steps=0",
        "algo.value_pretrain_steps=1", "rollout.prompts_per_step=4", "rollout.n_samples=2",
        "rollout.max_new_tokens=4", "trainer.total_steps=1", "trainer.tensorboard=false",
        # iteration 1 is the last (0: value pretraining)
        env={"VAPO_FAULT": "usr1@1", "VAPO_REQUEUE_FILE": str(marker)},
        module=faults.ENTRY, reap=True,
    )
    assert "[vapo] SIGUSR1 during the final step: finishing the run" in run.output, run.output[-3000:]
    assert "[vapo] stop (" not in run.output
    assert not run.leftovers, f"processes left running after the run: {run.leftovers}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    assert (run_dir / "hf" / "model.safetensors.index.json").is_file()
    assert not marker.exists()


EXIT_RACE = """
import os, signal, sys, time
import torch.distributed as dist
from vapo_megatron.trainer.signals import StopSignals, leave_together

StopSignals().install()  # as vapo-train: SIGTERM recorded, not fatal, while the program runs
dist.init_process_group("gloo")
if os.environ["MODE"] == "together":
    leave_together()
else:
    dist.barrier()
if dist.get_rank() == 1:
    signal.signal(signal.SIGTERM, signal.SIG_DFL) if os.environ["MODE"] == "plain" else None  # shutting down
    time.sleep(6)  # a slower teardown than rank 0's (the agent reacts within its 0.5 s monitor interval)
sys.exit(4)
"""


def _exit_codes(output: str) -> list[int]:
    import re

    by_pid = {pid: int(code) for code, pid in re.findall(r"exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)", output)}
    return sorted(by_pid.values())


def test_ranks_that_stop_together_each_keep_their_exit_code(tmp_path):
    """Both ranks end with exit code 4 (as after a non-finite stop); rank 1's teardown is slower. The
    first non-zero exit makes torchrun's agent SIGTERM rank 1: in plain mode, where SIGTERM is fatal
    again (Python restores its default action when it shuts down), rank 1 reports -15; after
    leave_together (vapo-train's way out), it keeps its own 4."""
    from tests.helpers.ports import free_port

    script = tmp_path / "exit_race.py"
    script.write_text(EXIT_RACE)
    codes = {}
    for mode in ("plain", "together"):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(free_port()), "--monitor-interval", "0.5", str(script)],
            env=dict(os.environ, PYTHONPATH=str(REPO), MODE=mode, OMP_NUM_THREADS="1"),
            capture_output=True, text=True, timeout=120, cwd=tmp_path)
        codes[mode] = _exit_codes(proc.stdout + proc.stderr)
        assert proc.returncode != 0 and codes[mode], (mode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert codes["plain"] == [-15, 4], codes  # the race this guards against, reproduced
    assert codes["together"] == [4, 4], codes
