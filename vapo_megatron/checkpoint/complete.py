"""Which of a run's checkpoints is whole, told from its files alone (no model, no process group).

    candidates(root)                    run_dir/checkpoints/iter_N to try, newest first (`latest` first)
    check_complete(path, models)        state.json parsed, complete, of this iteration, and every model's
                                        dist checkpoint whole; its content, or CheckpointCorrupt naming why
    finished_at(run_dir, models)        the newest checkpoint's iteration when the run finished there

The resume (manager.py) tries the candidates in this order and loads the first that passes. vapo-train
asks finished_at before it builds anything: a rerun or requeue of a finished run says "nothing to
train" without building a model or loading a checkpoint (minutes of a node at 32B).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from megatron.core import dist_checkpointing

from vapo_megatron.checkpoint import dist_io
from vapo_megatron.checkpoint.run_state import RunState


class CheckpointCorrupt(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names it."""


def candidates(root: Path, *, say_damage: bool = False) -> list[Path]:
    """Checkpoints to try, newest first: the `latest` pointer, then older ones. `say_damage`: print
    that a damaged pointer is ignored (the resume's rank 0)."""
    if not root.exists():
        return []
    found = sorted((p for p in root.glob("iter_*") if p.is_dir()), reverse=True)
    latest = root / "latest"
    if latest.exists():
        named = latest.read_text(errors="replace").strip()
        if re.fullmatch(r"iter_\d{7}", named):
            found = [root / named] + [p for p in found if p.name != named]
        elif say_damage:
            print(f"[vapo] {latest} is damaged (holds {named[:40]!r}, not iter_NNNNNNN); ignoring it", flush=True)
    return found


def check_complete(path: Path, models) -> dict:
    """The cheap checks, the same on every rank: state.json parses and names this iteration, every
    model's dist checkpoint has its metadata and whole storage files. Damage inside tensor files
    shows at load."""
    if not path.is_dir():
        raise CheckpointCorrupt(f"{path} does not exist")
    try:
        meta = json.loads((path / "state.json").read_text())
        RunState.check_json(meta["state"])
        meta["world_size"], meta["complete"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointCorrupt(f"{path / 'state.json'} is unreadable or incomplete "
                                f"({type(e).__name__}: {e})") from None
    if meta["complete"] is not True:
        raise CheckpointCorrupt(f"{path / 'state.json'}: not marked complete")
    iteration = meta["state"]["iteration"]
    if f"iter_{iteration:07d}" != path.name:
        raise CheckpointCorrupt(f"{path / 'state.json'} records iteration {iteration}, not that of {path.name}")
    for sub in models:
        if not dist_checkpointing.check_is_distributed_checkpoint(str(path / sub)):
            raise CheckpointCorrupt(f"{path / sub} is not a complete Megatron dist checkpoint "
                                    "(metadata.json missing or unreadable)")
        try:
            dist_io.check_storage(path / sub)  # every storage file whole, each damaged one named
        except dist_io.CheckpointError as e:
            raise CheckpointCorrupt(str(e)) from None
    return meta


def finished_at(run_dir: str | Path, models) -> int | None:
    """The iteration of the run's newest checkpoint when it passes check_complete and is marked
    finished (the final eval, export and save done); else None, and the resume decides (a damaged
    newest checkpoint falls back to an older one, which has more to train)."""
    found = candidates(Path(run_dir) / "checkpoints")
    if not found:
        return None
    try:
        state = check_complete(found[0], models)["state"]
    except CheckpointCorrupt:
        return None
    return state["iteration"] if "finished" in state and state["finished"] is True else None


def finished_message(run_dir: str, iteration: int, total_steps: int, total_iterations: int) -> str:
    """What a rerun of a finished run prints (rank 0) before it exits with 0."""
    return (f"[vapo] the run in {run_dir} has finished, at iteration {iteration} "
            f"(trainer.total_steps={total_steps} asks for {total_iterations}): nothing to train")


__all__ = ["CheckpointCorrupt", "candidates", "check_complete", "finished_at", "finished_message"]
