"""Shared by the tests that run the trainer and the commands end to end (tests/e2e): demo data, a
torchrun launch of `python -m vapo_megatron.train` that also reports processes the run left
behind, the same run (or another command's main) on ranks forked from the suite's preloaded
forkserver, and readers for what a run writes (metrics, checkpoints)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.helpers.ports import free_port
from tests.helpers.quiet_check import users_env

ROOT = Path(__file__).resolve().parents[2]
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def make_demo_data(out: Path, *, n_train: int, n_eval: int, n_sft: int) -> Path:
    """What `scripts/make_demo_data.py --out OUT --n-train .. --n-eval .. --n-sft ..` writes (its
    defaults: seed 0, the add task, the demo's model), in this process: a subprocess would spend
    most of its time importing torch and transformers again."""
    from vapo_megatron.tasks.demo_task import TinyModelSpec, write_demo_dir

    write_demo_dir(str(out), seed=0, task="add", n_train=n_train, n_eval=n_eval, n_sft=n_sft, sft_noise=0.0,
                   spec=TinyModelSpec())
    return out


@dataclass
class Launch:
    returncode: int  # torchrun's: 0, or 1 when a worker failed (the workers' codes are in its report)
    stdout: str
    stderr: str
    leftovers: list[str]  # processes of the run still alive after torchrun exited (killed by launch)
    codes: list[int | None] = field(default_factory=list)  # forked ranks only: each rank's (launch_in_forks)
    failures: list[str] = field(default_factory=list)  # forked ranks only: how those without a return value ended

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _set_subreaper(on: bool) -> bool:
    """Orphans of our descendants are re-parented to this process instead of init while on, so
    that a launch can find what its processes left running. Linux only; False elsewhere."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children() -> dict[int, str]:
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
            if int(rest.rsplit(") ", 1)[1].split()[1]) == os.getpid():
                out[int(pid)] = ((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                                 .decode(errors="replace")[:200])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


def launch(config: str | Path, overrides: list[str], *, env: dict[str, str] | None = None, nproc: int = 2,
           torchrun_args: tuple[str, ...] = (), timeout: float = 600, module: str = "vapo_megatron.train") -> Launch:
    """`python -m torch.distributed.run -m vapo_megatron.train` on this machine (gloo, CPU); `module`:
    another entry point taking the same arguments (tests/helpers/collective_audit.py; with VAPO_FAULT,
    tests/helpers/faults.py)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *torchrun_args,
        "-m", module, "--config", str(ROOT / "configs" / config), *overrides,
    ]
    full_env = {**users_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    reaping = _set_subreaper(True)
    before = _children() if reaping else {}
    # Output goes to files, not pipes: a process the run leaves behind would hold a pipe open and
    # keep subprocess waiting for its end.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            returncode = subprocess.run(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=err, timeout=timeout).returncode
        finally:
            leftovers = _end_orphans(before) if reaping else []
        out.seek(0)
        err.seek(0)
        return Launch(returncode, out.read(), err.read(), leftovers)


def _end_orphans(before: dict[int, str]) -> list[str]:
    """Kill and reap the processes re-parented to us during a launch; returns them."""
    time.sleep(0.2)  # a dying worker's helpers are re-parented as it exits
    leftovers = {pid: cmdline for pid, cmdline in _children().items() if pid not in before}
    alive = {pid: c for pid, c in leftovers.items() if not _is_zombie(pid)}  # a zombie has exited: not left running
    for pid in leftovers:  # our own orphans: end them and collect their exit status
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    _set_subreaper(False)
    return [f"{pid}: {c}" for pid, c in alive.items()]


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone already


def train(config: str | Path, *overrides: str, env: dict[str, str] | None = None, nproc: int = 2,
          module: str = "vapo_megatron.train") -> Launch:
    """A launch that must succeed and leave no process behind."""
    run = launch(config, list(overrides), env=env, nproc=nproc, module=module)
    assert run.returncode == 0, f"vapo-train failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    assert not run.leftovers, f"processes left running after the run: {run.leftovers}"
    return run


def _rank_main(argv: list[str], out_dir: str, env: dict[str, str], nproc: int, module: str) -> int:
    """One rank of command_in_forks: `module`'s main(ARGV) with what torchrun gives a worker besides
    RANK, WORLD_SIZE and the rendezvous (set by end_ranks), its output in out_dir/rank{R}.{out,err}."""
    os.chdir(ROOT)
    os.environ.update(env, LOCAL_WORLD_SIZE=str(nproc))
    from tests.helpers.dist_utils import command_main

    return command_main(module, argv, out_dir)


def launch_in_forks(config: str | Path, overrides: list[str], *, env: dict[str, str] | None = None, nproc: int = 2,
                    module: str = "vapo_megatron.train", reap: bool = False, timeout: float = 600.0) -> Launch:
    """`module`'s main(["--config", CONFIG, *overrides]) on `nproc` ranks forked from the preloaded
    forkserver of tests/helpers/dist_utils.py instead of started by torchrun (command_in_forks)."""
    return command_in_forks(module, ["--config", str(ROOT / "configs" / config), *overrides], env=env, nproc=nproc,
                            reap=reap, timeout=timeout)


def command_in_forks(module: str, argv: list[str], *, env: dict[str, str] | None = None, nproc: int = 1,
                     reap: bool = False, timeout: float = 600.0) -> Launch:
    """`module`'s main(argv) (a command: vapo_megatron.train, .eval, .convert, tests.helpers.faults)
    on `nproc` ranks forked from the preloaded forkserver of tests/helpers/dist_utils.py instead of
    started by torchrun or `python -m`: the same main from the command line on, without the ~5-7 s
    of CPU that each fresh interpreter spends importing torch, megatron-core and transformers. For
    the tests whose subject is what a command computes or records, also when it fails or is
    killed; those about the launch itself (torchrun's report, signals to it, a process's own
    output and exit) start real processes (launch()). Whatever the ranks' end, returns it:
    codes: each rank's exit code as its process would have it (main's return value; 1 where main
    raised, its traceback then in stderr; -N where the rank died of signal N, as a SIGKILL fault
    point kills it; None where it had not ended 5 s after another rank failed, and was killed, as
    torchrun's agent ends the rest of a job), returncode the first that is not 0 (None as -9),
    failures: how the ranks without a return value ended; stdout and stderr: the ranks' in rank
    order; leftovers (with `reap`): processes the ranks left running, found and killed as launch()
    does. Without `reap` they are left to end by themselves (re-parented to init), as a killed
    command's helpers are (an SGLang engine's processes, which tests/e2e/test_sglang_train_resume.py
    watches die by themselves; W&B's service)."""
    from tests.helpers.dist_utils import end_ranks, start_forkserver

    start_forkserver()  # before the census of our children: the server is the suite's, not the run's
    reaping = reap and _set_subreaper(True)
    before = _children() if reaping else {}
    with tempfile.TemporaryDirectory() as out:
        try:
            ended = end_ranks(nproc, _rank_main, argv, out, dict(env or {}), nproc, module, timeout=timeout)
        finally:
            leftovers = _end_orphans(before) if reaping else []
        text = {k: "".join(Path(out, f"rank{r}.{k}").read_text() for r in range(nproc)
                           if Path(out, f"rank{r}.{k}").exists())
                for k in ("out", "err")}
    codes = [(ended.results[r] or 0) if r in ended.results else 1 if r in ended.raised else ended.exitcodes[r]
             for r in range(nproc)]
    tracebacks = "".join(ended.failures[r].split("\n", 1)[1] for r in sorted(ended.raised))
    first = next((c for c in codes if c != 0), 0)
    return Launch(-9 if first is None else first, text["out"], text["err"] + tracebacks, leftovers, codes,
                  list(ended.failures.values()))


def train_in_forks(config: str | Path, *overrides: str, env: dict[str, str] | None = None, nproc: int = 2,
                   module: str = "vapo_megatron.train", reap: bool = False, timeout: float = 600.0) -> Launch:
    """A run that must succeed, as train() but with its ranks forked (launch_in_forks). `module`:
    another entry point taking the same arguments (tests/helpers/collective_audit.py)."""
    run = launch_in_forks(config, list(overrides), env=env, nproc=nproc, module=module, reap=reap, timeout=timeout)
    assert run.returncode == 0 and not run.failures, \
        f"vapo-train failed ({run.codes}): {run.failures}\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    return run


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def small_run_overrides(data: Path, run_dir: Path) -> list[str]:
    """Two short VAPO steps on the demo data (make_demo_data) with the model in data/model: no
    warm start, no value pretraining, no intermediate checkpoint, eval or export."""
    return [
        f"trainer.run_dir={run_dir}", f"model.hf_path={data}/model",
        f"data.train_files=[{data}/train.jsonl]", f"data.eval_files=[{data}/eval.jsonl]",
        f"sft.files=[{data}/sft.jsonl]", "sft.steps=0", "algo.value_pretrain_steps=0",
        "rollout.prompts_per_step=4", "rollout.n_samples=2", "algo.mini_batches=2", "eval.max_prompts=4",
        "trainer.total_steps=2", "trainer.save_every=100", "eval.every=100", "trainer.tensorboard=false",
        "trainer.export_hf=false",
    ]


def hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a sharded HF safetensors export (through its index)."""
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(hf_dir / shard)))
    assert out.keys() == index["weight_map"].keys()
    return out


def exported(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    """A trainer checkpoint's weights, through `vapo-convert mcore-to-hf` (its main on one forked rank)."""
    if not out.exists():
        run = command_in_forks("vapo_megatron.convert", ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out)])
        assert (run.returncode == 0
                and not run.failures), f"vapo-convert failed ({run.codes}): {run.failures}\n{run.stderr[-3000:]}"
    return hf_weights(out)


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Megatron dist checkpoint (torch_dist format: weights and optimizer state),
    read with torch.distributed.checkpoint in this process, without a process group."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    import vapo_megatron.checkpoint.dist_io  # noqa: F401 - installs the restricted unpickling first

    reader = FileSystemReader(str(ckpt))
    meta = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if isinstance(m, TensorStorageMetadata)}
    load(out, storage_reader=reader, no_dist=True)
    return out
