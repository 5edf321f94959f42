"""SGLang's CPU engine in the suite: the one place that says what it needs here.

sglang 0.5.23 runs on the CPU (its own CPU path, SGLANG_USE_CPU_ENGINE=1) given sgl-kernel's CPU
build, which no registry publishes: tests/doubles/sglang/sgl_kernel stands in for it (TEST DOUBLE;
what it provides and why: its docstring). Everything else is SGLang itself: its Engine, scheduler
and detokenizer processes, HTTP server, model classes, weight loaders, sampler, radix cache.

    sglang_env(base)              os.environ with SGLang's CPU switch and the sgl_kernel double on PYTHONPATH
    enter_sglang_world()          the same for this process (before sglang is imported)
    start_server(model, log)      `python -m sglang.launch_server` on a loopback port -> (process, url)
    stop_process_tree(proc)       the server and its schedulers, ended
    main(argv)                    vapo-train's main in this world, VAPO_FAULT honoured (a rank forked by train_in_forks,
                                  or `python -m tests.helpers.sglang_world --config ...` in a process of its own)

A test that cannot start the engine fails: nothing here skips.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SGLANG_DOUBLES = ROOT / "tests" / "doubles" / "sglang"
SGL_KERNEL_DOUBLE = SGLANG_DOUBLES / "sgl_kernel"

# What makes a server start cheap here, each one of SGLang's own server arguments (measured: docs/
# what_ran_where.md, "SGLang"): a KV cache of a few thousand tokens, not a share of the host's memory
# (SGLang's CPU probe: mem_fraction_static 0.5 gave 9 GB of float32 cache, 28 s to allocate); no
# warmup request; an idle scheduler that sleeps instead of polling a whole core. CUDA graphs are off
# by themselves with torch_native attention. (Colocated engines get the production engine_kwargs
# with the same cap on the cache: tests/distributed/test_sglang_colocated_real.py.)
SERVER_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32", "--skip-tokenizer-init",
               "--skip-server-warmup", "--max-total-tokens", "4096", "--sleep-on-idle", "--log-level", "warning")


def sglang_env(base: dict | None = None) -> dict[str, str]:
    """`base` (default os.environ) for a process that runs SGLang on the CPU: SGLang's own switch for
    its CPU engine (utils/common.py is_cpu) and the sgl_kernel double first on PYTHONPATH, so that
    the engine's spawned scheduler and detokenizer processes import it too."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    paths = [str(SGLANG_DOUBLES), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def enter_sglang_world() -> None:
    """This process runs SGLang's CPU engine from now on (a forked test rank, a world's driver):
    sglang_env() in os.environ for the processes it spawns, and the double importable here. Must
    run before sglang's utils are imported (is_cpu() is cached on first call)."""
    if "sglang.srt.utils.common" in sys.modules and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        raise RuntimeError("sglang was imported before its CPU switch was set: SGLang would run its CUDA path")
    os.environ.update(sglang_env())
    if str(SGLANG_DOUBLES) not in sys.path:
        sys.path.insert(0, str(SGLANG_DOUBLES))


def start_server(model_path: str | Path, log: Path, *, port: int, extra: tuple[str, ...] = (),
                 timeout: float = 600.0) -> tuple[subprocess.Popen, str]:
    """A real `python -m sglang.launch_server` on the CPU at 127.0.0.1:port, waited for until its
    /health_generate answers; its output goes to `log`. Fails (never skips) when it does not start."""
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", "127.0.0.1",
            "--port", str(port), *SERVER_ARGS, *extra]
    out = open(log, "wb")
    proc = subprocess.Popen(args, cwd=ROOT, env=sglang_env(), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"sglang.launch_server exited {proc.returncode} while starting:\n"
                                 f"{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"{url}/server_info", timeout=5) as r:
                json.loads(r.read())
            return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_process_tree(proc)
            raise AssertionError(f"sglang.launch_server did not answer within {timeout:.0f} s:\n"
                                 f"{log.read_text()[-6000:]}")
        time.sleep(1.0)


def stop_process_tree(proc: subprocess.Popen) -> None:
    """End a server started by start_server and everything it started (its own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main(argv: list[str]) -> int:
    """vapo-train's main(argv) in SGLang's CPU world: the entry point of a trainer rank forked by
    tests/helpers/train_runs.py train_in_forks(module="tests.helpers.sglang_world"), which cannot set
    the world up before vapo_megatron.train runs. It is tests/helpers/faults.py's main (vapo-train
    with the test-only fault hook): VAPO_FAULT kills such a run where a test asks, and does nothing
    when unset."""
    enter_sglang_world()
    from tests.helpers.faults import main as faults_main

    return faults_main(argv)


if __name__ == "__main__":  # vapo-train as a user's terminal runs it, in a process of its own (sglang_env() given)
    sys.exit(main(sys.argv[1:]))
