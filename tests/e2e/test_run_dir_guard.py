"""A run directory belongs to one trainer, and a refused resume leaves it as it was
(vapo_megatron/trainer/run_guard.py, checkpoint/manager.py's mismatch check; issue 25, items 2-3).

On the tiny demo model. The second trainer is the real CLI: torchrun with two gloo workers, paused
(SIGSTOP) while a single-process `python -m vapo_megatron.train` on the same run directory starts
and is refused, so that they spend no CPU meanwhile, then let go on and killed with their launcher.
The mismatch runs vapo-train's main on one rank forked from the suite's preloaded forkserver
(tests/helpers/train_runs.py launch_in_forks: main's return value is the exit code, its output the
command's)."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.ports import free_port
from tests.helpers.train_runs import Launch, launch_in_forks

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_cpu.yaml"


def _base(demo: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        f"trainer.run_dir={run_dir}", f"model.hf_path={demo}/model", f"data.train_files=[{demo}/train.jsonl]",
        "data.eval_files=[]", "sft.files=[]", "sft.steps=0", "algo.value_pretrain_steps=0",
        "algo.mini_batches=1", "rollout.prompts_per_step=4", "rollout.n_samples=2", "rollout.max_new_tokens=4",
        f"trainer.total_steps={steps}", "trainer.tensorboard=false", "trainer.export_hf=false",
    ]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vapo_megatron.train", "--config", str(CONFIG), "parallel.tp=1", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)


def _forked(*args: str) -> Launch:
    return launch_in_forks(CONFIG, ["parallel.tp=1", *args], nproc=1)


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            child, rest = stat.read_text().split(" (", 1)
            if int(rest.rsplit(") ", 1)[1].split()[1]) == pid:
                out.append(int(child))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_second_trainer_is_refused_and_workers_die_with_their_launcher(demo, tmp_path):
    run_dir = tmp_path / "run"
    log = open(tmp_path / "torchrun.log", "w")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "vapo_megatron.train", "--config", str(CONFIG), "parallel.tp=2",
         *_base(demo, run_dir, steps=500)],
        cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").is_file():  # the trainer is up and training
            assert launcher.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer did not start"
            time.sleep(0.5)
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        rank0 = next(w for w in workers if b"\0RANK=0\0" in b"\0" + Path(f"/proc/{w}/environ").read_bytes())

        # The user's natural next step, the same command again: refused at once, naming the holder.
        # The workers wait meanwhile, stopped: they hold the lock all the same.
        for w in workers:
            os.kill(w, signal.SIGSTOP)
        second = _cli(*_base(demo, run_dir, steps=500))
        for w in workers:
            os.kill(w, signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-3000:]
        assert (f"trainer.run_dir={run_dir} is in use by another trainer (host {socket.gethostname()}, "
                f"pid {rank0}, since ") in second.stderr, second.stderr[-3000:]
        assert "Traceback" not in second.stderr

        # kill -9 of the launcher's process group: torchrun started the workers in sessions of
        # their own, so only the parent-death signal reaches them.
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [w for w in workers if _alive(w)], "workers outlived their launcher"

        # The kernel released the lock with its holder: a new trainer could take it.
        fd = os.open(run_dir / ".vapo-lock", os.O_RDWR)
        try:
            deadline = time.monotonic() + 20  # the kernel drops a dead holder's locks as it reaps it
            while True:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    assert time.monotonic() < deadline, ("the lock outlived its holder: "
                                                         f"{Path('/proc/locks').read_text()}")
                    time.sleep(0.2)
        finally:
            os.close(fd)
    finally:
        for pid in [launcher.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def test_a_resume_with_another_model_is_a_mismatch_and_leaves_the_run_as_it_was(demo, tmp_path):
    from vapo_megatron.tasks.demo_task import TinyModelSpec, write_demo_dir

    run_dir = tmp_path / "run"
    base = _base(demo, run_dir, steps=1)
    first = _forked(*base)
    assert first.returncode == 0, first.stderr[-3000:]
    record = (run_dir / "config.yaml").read_bytes()

    other = tmp_path / "other"
    write_demo_dir(str(other), seed=0, task="add", n_train=8, n_eval=0, n_sft=0, sft_noise=0.0,
                   spec=TinyModelSpec(intermediate_size=128))
    proc = _forked(*base, f"model.hf_path={other}/model", "trainer.total_steps=2", "trainer.allow_config_change=true")
    assert proc.returncode == 2, proc.stderr[-3000:]
    ckpt = run_dir / "checkpoints" / "iter_0000001"
    assert (f"vapo-train: checkpoint error: {ckpt}/actor holds another model than the one built from "
            f"{other}/model: " in proc.stderr)
    assert ("decoder.layers.mlp.linear_fc2.weight is [2, 64, 256] in the checkpoint, "
            "[2, 64, 128] in the model" in proc.stderr)
    assert "the checkpoints are intact" in proc.stderr and "damaged" not in proc.stdout + proc.stderr
    assert (run_dir / "config.yaml").read_bytes() == record  # the run's record is untouched

    again = _forked(*base)  # the original command still resumes the run (and finds it finished)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "has finished, at iteration 1 (trainer.total_steps=1 asks for 1): nothing to train" in again.stdout
