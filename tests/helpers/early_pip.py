"""The GPU install's pip resolution (tests/unit/test_pins.py), started when the session starts.

The dry run spends about a minute waiting on the package index. Started by the xdist controller at
configure time, it waits while both workers run other tests; the test then reads its result. A
run that does not select test_pins.py (one file, say) starts nothing, and the test, run alone,
resolves in its own process as before.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PINS_TEST = REPO / "tests" / "unit" / "test_pins.py"
ENV = "VAPO_EARLY_GPU_RESOLUTION"  # the folder the workers read it from (they inherit the environment)


def command(report: Path) -> list[str]:
    # --no-build-isolation: the project's metadata is built with this venv's setuptools (the
    # build requirement is met), not a fresh one pip would install into a temporary overlay first.
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--no-build-isolation", "--report", str(report), f"{REPO}[gpu]"]


def _selects_pins_test(args: list[str]) -> bool:
    for arg in args or ["."]:
        path = Path(arg.split("::", 1)[0]).resolve()
        if path == PINS_TEST or path in PINS_TEST.parents:
            return True
    return False


def start(config) -> None:
    """pytest_configure: in the controller (or a run without xdist), when test_pins.py is selected."""
    if hasattr(config, "workerinput") or os.environ.get(ENV) or not _selects_pins_test(config.args):
        return
    folder = Path(tempfile.mkdtemp(prefix="vapo_gpu_resolution_"))
    runner = ("import subprocess, sys; p = subprocess.run(sys.argv[2:], capture_output=True, text=True);"
              "open(sys.argv[1] + '/out.txt', 'w').write(p.stdout + p.stderr);"
              "open(sys.argv[1] + '/rc.tmp', 'w').write(str(p.returncode));"
              "__import__('os').replace(sys.argv[1] + '/rc.tmp', sys.argv[1] + '/rc')")
    # At nice 19 (pip inherits it): its ~40 s of CPU (parsing the index's ~190k links) then takes
    # the cores only while both workers wait (on Slurm, signals, process start-up), instead of
    # sharing them with the tests; the test reads the result some ten minutes later.
    proc = subprocess.Popen([sys.executable, "-c", runner, str(folder), *command(folder / "report.json")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19))
    config._vapo_early_pip = (proc, folder)
    os.environ[ENV] = str(folder)


def stop(config) -> None:
    """pytest_unconfigure: a resolution still running is stopped; its folder removed."""
    started = getattr(config, "_vapo_early_pip", None)
    if started is None:
        return
    proc, folder = started
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)
    os.environ.pop(ENV, None)


def result(report: Path, timeout_s: float = 900) -> tuple[int, str]:
    """(returncode, output) of the resolution, its report at `report`: the early one when the
    session started it, else run here."""
    folder = os.environ.get(ENV)
    if folder and Path(folder).is_dir():
        rc = Path(folder) / "rc"
        deadline = time.monotonic() + timeout_s
        while not rc.exists():
            if time.monotonic() > deadline:
                raise AssertionError("the GPU install's resolution started at session start did not end in "
                                     f"{timeout_s:.0f} s")
            time.sleep(0.5)
        if (Path(folder) / "report.json").exists():
            shutil.copy(Path(folder) / "report.json", report)
        return int(rc.read_text()), (Path(folder) / "out.txt").read_text()
    proc = subprocess.run(command(report), capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode, proc.stdout + proc.stderr
