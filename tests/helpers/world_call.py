"""The child side of worlds.call_in_world: `python -m tests.helpers.world_call WORLD JOB OUT`, started
with the world's stand-ins on PYTHONPATH. Checks that megatron-core sees the world it was asked for
(world_main.check_world), calls the job's function in this process, and writes its result. For a
world's checks that need no ranks, or that start their own (train_in_forks, run_ranks: their
forkserver is started from this interpreter, so its ranks are in the same world)."""

from __future__ import annotations

import importlib
import pickle
import sys
from pathlib import Path

from tests.helpers.world_main import check_world


def main(argv: list[str]) -> int:
    world, job, out = argv
    check_world(world)
    module, qualname, args = pickle.loads(Path(job).read_bytes())  # our parent's job
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    Path(out).write_bytes(pickle.dumps(fn(*args)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
