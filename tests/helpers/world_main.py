"""The child side of worlds.run_in_world: `python -m tests.helpers.world_main WORLD JOB OUT`, started
with the world's stand-ins on PYTHONPATH. Checks that megatron-core sees the world it was asked
for, runs the job on forked gloo ranks, and writes the results."""

from __future__ import annotations

import importlib
import pickle
import sys
from pathlib import Path


def check_world(world: str) -> None:
    """Fail loudly when the stand-ins did not take: a test meant for the TE world that ran megatron's
    local branches would pass without testing anything."""
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.transformer import transformer_block

    from vapo_megatron.mcore.models import wgrad_fusion_hardware

    want_te = world in ("te", "te_apex")
    want_apex = world in ("apex", "te_apex")
    if bool(HAVE_TE) != want_te or bool(transformer_block.HAVE_APEX) != want_apex:
        raise SystemExit(f"world {world}: megatron-core sees HAVE_TE={HAVE_TE} HAVE_APEX={transformer_block.HAVE_APEX}")
    fused = wgrad_fusion_hardware(None)  # worlds.world_env: the fusion where TE and Apex both import
    if fused != (world == "te_apex"):
        raise SystemExit(f"world {world}: gradient_accumulation_fusion's switch is {'on' if fused else 'off'}")


def main(argv: list[str]) -> int:
    world, job, out = argv
    check_world(world)
    from tests.helpers.dist_utils import run_ranks

    module, qualname, world_size, args, timeout = pickle.loads(Path(job).read_bytes())  # our parent's job
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    # world_size 0: a driver (worlds.drive_in_world), run here; it forks its own ranks.
    results = fn(*args) if world_size == 0 else run_ranks(world_size, fn, *args, timeout=timeout)
    Path(out).write_bytes(pickle.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
