"""The GPU nodes' library worlds, on the CPU: megatron-core takes other branches when Transformer
Engine or Apex imports (HAVE_TE, HAVE_APEX: other layer classes, norms, Adam, checkpoint keys).
The suite runs those branches through pure-torch stand-ins of what megatron-core imports from
each library (tests/doubles/<world>/: test doubles, never shipped).

    world_env("te")                          os.environ with the world's stand-ins first on PYTHONPATH
    run_in_world("te", 2, fn, *args)         fn(*args) on 2 gloo ranks in that world -> [result per rank]
    call_in_world("apex", fn, *args)         fn(*args) in one fresh interpreter of that world -> its result

A world is a set of importable stand-in packages, so it is fixed when a process imports
megatron-core: the suite's own processes (and dist_utils' forkserver) are the local world, and a
world runs in a fresh interpreter (tests/helpers/world_main.py) with its own forkserver.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOUBLES = ROOT / "tests" / "doubles"
# te: Transformer Engine (pip's GPU install); apex: Apex without TE; te_apex: both (NGC images).
WORLDS = {"local": [], "te": ["te"], "apex": ["apex"], "te_apex": ["te", "apex"]}


def world_path(world: str) -> list[str]:
    if world not in WORLDS:
        raise ValueError(f"unknown world {world!r}; one of {sorted(WORLDS)}")
    return [str(DOUBLES / d) for d in WORLDS[world]]


def world_env(world: str, base: dict | None = None) -> dict[str, str]:
    """`base` (default os.environ) with the world's stand-ins and the repository first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([*world_path(world), str(ROOT)])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_in_world(world: str, world_size: int, fn, *args, timeout: float = 600.0) -> list:
    """fn(*args) on `world_size` gloo ranks of a fresh interpreter in `world`; fn must be importable
    (a module-level function). Returns each rank's result, as dist_utils.run_ranks does."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.pkl"
        out = Path(tmp) / "out.pkl"
        job.write_bytes(pickle.dumps((fn.__module__, fn.__qualname__, world_size, args, timeout)))
        proc = subprocess.run([sys.executable, "-m", "tests.helpers.world_main", world, str(job), str(out)],
                              cwd=ROOT, env=world_env(world), capture_output=True, text=True, timeout=timeout + 60)
        if proc.returncode != 0 or not out.exists():
            raise AssertionError(f"world {world}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        return pickle.loads(out.read_bytes())  # our own child's results


def call_in_world(world: str, fn, *args, timeout: float = 900.0):
    """fn(*args) in one fresh interpreter of `world` (tests/helpers/world_call.py), no ranks: for
    checks that need none, or that start their own (train_in_forks, run_ranks: their forkserver is
    started from that interpreter, so it is in the same world). fn must be importable."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.pkl"
        out = Path(tmp) / "out.pkl"
        job.write_bytes(pickle.dumps((fn.__module__, fn.__qualname__, args)))
        proc = subprocess.run([sys.executable, "-m", "tests.helpers.world_call", world, str(job), str(out)],
                              cwd=ROOT, env=world_env(world), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            raise AssertionError(f"world {world}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        return pickle.loads(out.read_bytes())  # our own child's result
