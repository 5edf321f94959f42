"""The GPU nodes' library worlds, on the CPU: megatron-core takes other branches when Transformer
Engine or Apex imports (HAVE_TE, HAVE_APEX: other layer classes, norms, Adam, checkpoint keys).
The suite runs those branches through pure-torch stand-ins of what megatron-core imports from
each library (tests/doubles/<world>/: test doubles, never shipped).

    world_env("te")                          os.environ with the world's stand-ins first on PYTHONPATH
    run_in_world("te", 2, fn, *args)         fn(*args) on 2 gloo ranks in that world -> [result per rank]
    drive_in_world("te", fn, *args)          fn(*args) in the world's interpreter itself -> its result;
                                             fn starts ranks as the suite does (train_in_forks,
                                             run_ranks, run_command), all forked from that interpreter
    run_command(module, argv, nproc=1)       a command's main(argv) on forked ranks of this process

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
    """`base` (default os.environ) with the world's stand-ins and the repository first on PYTHONPATH;
    in a world with Transformer Engine, models built where the hardware decides get TE's layer spec
    on the CPU too (mcore/models.py te_spec), or TE's modules would never run; in the world with TE
    AND Apex, also gradient_accumulation_fusion, as on a GPU node with both (models.py
    wgrad_fusion_hardware: TE's linears accumulate their weight gradients into main_grad)."""
    from vapo_megatron.mcore.models import TE_SPEC_ON_CPU, WGRAD_FUSION_ON_CPU

    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([*world_path(world), str(ROOT)])
    env.setdefault("OMP_NUM_THREADS", "1")
    for switch, on in ((TE_SPEC_ON_CPU, "te" in WORLDS[world]), (WGRAD_FUSION_ON_CPU, world == "te_apex")):
        if on:
            env[switch] = "1"
        else:
            env.pop(switch, None)
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


def drive_in_world(world: str, fn, *args, timeout: float = 1800.0):
    """fn(*args) in a fresh interpreter of `world`, outside any process group: a driver that runs
    several commands or rank functions in that world pays for the interpreter and its forkserver's
    imports once. Returns fn's result."""
    return run_in_world(world, 0, fn, *args, timeout=timeout)


def command_rank(module: str, argv: list[str], out_dir: str) -> int:
    """One rank of run_command: `module`'s main(argv), its output in out_dir/rank{R}.{out,err}."""
    os.chdir(ROOT)
    from tests.helpers.dist_utils import command_main

    return command_main(module, argv, out_dir)


def run_command(module: str, argv: list[str], *, nproc: int = 1, timeout: float = 600.0) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `module`'s main(argv) on `nproc` ranks forked from this
    process's forkserver (tests/helpers/dist_utils.py), in whatever world this process is."""
    from tests.helpers.dist_utils import run_ranks

    with tempfile.TemporaryDirectory() as out:
        codes = run_ranks(nproc, command_rank, module, argv, out, timeout=timeout)
        text = {k: "".join(Path(out, f"rank{r}.{k}").read_text() for r in range(nproc)) for k in ("out", "err")}
    return max(codes, key=abs), text["out"], text["err"]
