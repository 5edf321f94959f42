"""The run's checkpoints: save, resume, and fall back past a damaged one.

    ckpt = CheckpointManager(run_dir, {"actor": actor_model, "critic": critic_model}, config=run_record(cfg))
    ckpt.save(state)         collective: run_dir/checkpoints/iter_N, atomically
    ckpt.load(state)         collective: resume from the newest loadable checkpoint (False: none)

A checkpoint is run_dir/checkpoints/iter_NNNNNNN/ holding
    actor/, critic/   each a Megatron dist checkpoint (weights + optimizer state) with hf/ and
                      vapo.json, so `vapo-convert mcore-to-hf --ckpt .../actor` works on it
    state.json        the RunState (checkpoint/run_state.py), each model's LR-schedule position, the config
    rng/rank_R.safetensors   each rank's torch RNG state (uint8 tensor)
    carry_over.safetensors   partial rollout's groups in flight, every DP rank's (only when there are any)
It is written under a temporary name, flushed, and renamed into place when complete; then the
`latest` pointer file is replaced atomically (runtime/atomic.py). A crash at any point leaves the previous
checkpoint as the latest; a damaged one is detected on load and the previous one is used
(docs/faults.md). Dist checkpoints load at any TP/PP layout.
"""

from __future__ import annotations

import errno
import json
import shutil
from functools import partial
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException

from vapo_megatron.checkpoint import dist_io  # also installs safe_unpickle: no checkpoint pickle runs code
from vapo_megatron.checkpoint.complete import CheckpointCorrupt, candidates, check_complete
from vapo_megatron.checkpoint.model_state import (
    at_layout,
    has_distributed_optimizer,
    load_model_state,
    resume_layout_problem,
    save_model_state,
    saved_layout,
    saved_optimizer_format,
)
from vapo_megatron.checkpoint.run_state import RunState
from vapo_megatron.config.resume import ep_change
from vapo_megatron.data import carry_over
from vapo_megatron.mcore import parallel
from vapo_megatron.mcore.model import TrainModel
from vapo_megatron.mcore.optimizer import set_lr_steps
from vapo_megatron.runtime import fault_points
from vapo_megatron.runtime.atomic import commit_dir, fsync_path, staging_dir, staging_path, write_atomic

KEEP_CHECKPOINTS = 2
T = TypeVar("T")


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank (every rank raises it); the message says what, where, and, when
    the file system failed, the free space. vapo-train exits with SAVE_FAILED_EXIT_CODE."""

    def __init__(self, message: str, *, file_system: bool = False) -> None:
        super().__init__(message)
        self.file_system = file_system  # an OSError behind it (a full disk, a lost mount), on some rank


class CheckpointMismatch(RuntimeError):
    """A healthy checkpoint of another model: the message names the tensors and both shapes."""


# ---- collective agreement ------------------------------------------------------------------------

def _root_cause(e: BaseException) -> BaseException:
    """The error a failure started with, through torch DCP's per-rank CheckpointException and the
    `raise ... from` of the writers (megatron's FileSystemWriterAsync reports a writer's error as
    `RuntimeError("Worker failure: ...") from` it)."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, CheckpointException) and e.failures:
            e = next(iter(e.failures.values()))[0]
        elif e.__cause__ is not None:
            e = e.__cause__
        else:
            break
    return e


def _one_line(e: BaseException) -> str:
    """A short reason: the root cause's type and the last line of its message."""
    e = _root_cause(e)
    if isinstance(e, (CheckpointCorrupt, dist_io.CheckpointError)):  # already one line naming the file
        return str(e)
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def os_error_of(e: BaseException | None) -> OSError | None:
    """The OSError behind a failure, through torch DCP's per-rank wrapping and exception chains."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e
        if isinstance(e, CheckpointException) and e.failures:
            e = next(iter(e.failures.values()))[0]
            continue
        e = e.__cause__ or e.__context__
    return None


def save_reason(e: BaseException) -> str:
    """One line: the OS error and its file when there is one (ENOSPC is otherwise buried under
    torch DCP's and megatron's wrapping), else the last line of the error."""
    os_error = os_error_of(e)
    if os_error is not None:
        where = f": {os_error.filename}" if os_error.filename else ""
        return f"{os_error.strerror} (errno {os_error.errno}){where}"
    return _one_line(e)


def _free_space(path: Path) -> str:
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return "free space unknown"
    return f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"


def _agreed(step: Callable[[], None]) -> None:
    """Collective: run one phase of a save on every rank, then agree; when it failed anywhere,
    every rank raises CheckpointSaveError with the first failing rank's reason (a rank going on
    alone would meet the others' next collective out of step)."""
    reason, file_system = "", False
    try:
        step()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported by every rank below
        reason, file_system = f"rank {dist.get_rank()}: {save_reason(e)}", os_error_of(e) is not None
    reasons = [("", False)] * dist.get_world_size()
    parallel.all_gather_object(reasons, (reason, file_system))
    bad = next((r for r in reasons if r[0]), None)
    if bad:
        raise CheckpointSaveError(bad[0], file_system=any(f for _, f in reasons))


def _on_every_rank(step: Callable[[], T]) -> T:
    """Collective: run one step of a resume on every rank and agree on its outcome before any
    rank goes on. When it failed on some rank, it raises CheckpointCorrupt on all, with the
    first failing rank's reason. Megatron reads each rank's shards without collectives, so a
    damaged file fails only on the ranks that read it; a rank that went on alone would meet the
    others' collectives of the next load (or of the fallback) out of step."""
    result, reason = None, ""
    try:
        result = step()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any damage means: try an older one
        reason = _one_line(e)
    reasons = [""] * dist.get_world_size()
    parallel.all_gather_object(reasons, reason)
    bad = next((r for r in reasons if r), "")
    if bad:
        raise CheckpointCorrupt(bad)
    return result


# ---- the manager -------------------------------------------------------------------------------

class CheckpointManager:
    def __init__(self, run_dir: str | Path, models: dict[str, TrainModel], *, config: dict,
                 keep: int = KEEP_CHECKPOINTS):
        self.root = Path(run_dir) / "checkpoints"
        self.models, self.config, self.keep = models, config, keep
        self.carried = 0  # the groups the checkpoint being written carries over (all DP ranks)

    def _remove_leftovers(self) -> None:
        """A crashed save leaves `.iter_N.tmp` (or `.old`/`.del`) behind; nothing reads them."""
        for p in self.root.glob(".iter_*"):
            shutil.rmtree(p, ignore_errors=True)

    def save(self, state: RunState) -> Path:
        """Collective. Writes iter_N under a temporary name, flushes it, renames it into place, then
        moves `latest` to it; keeps the newest few. A crash at any point leaves `latest` naming a
        complete checkpoint (docs/faults.md). Any rank's failure (a full disk, a lost file system)
        fails every rank together after the phase it happened in: the partial directory is removed
        and CheckpointSaveError says what failed, where, and how much space was left."""
        name = f"iter_{state.iteration:07d}"
        target = self.root / name
        tmp = staging_path(target)
        try:
            _agreed(partial(self._begin, target))
            for sub, model in self.models.items():
                _agreed(at_layout(model, partial(save_model_state, model, tmp / sub)))
                if sub == "actor":
                    fault_points.point("checkpoint")  # a crash mid-write (runtime/fault_points.py)
            _agreed(partial(self._write_rng, tmp))
            _agreed(partial(self._write_carry, tmp, state))
            _agreed(partial(self._commit, tmp, target, state))
        except CheckpointSaveError as e:
            free_then = _free_space(self.root)
            if parallel.is_rank0():
                shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint only keeps the disk full
            # The free space only where the file system failed: after any other error (a bug, a
            # signal's exception) it read as if the disk were to blame.
            space = (f"; {free_then} on the file system of {self.root} when it failed ({_free_space(self.root)} "
                     "after removing the partial checkpoint)") if e.file_system else ""
            raise CheckpointSaveError(
                f"saving {target} failed: {e}{space}; {self.root / 'latest'} still names the last complete checkpoint",
                file_system=e.file_system) from None
        return target

    def _begin(self, target: Path) -> None:
        if parallel.is_rank0():
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()
            self._check_room(target)
            (staging_dir(target) / "rng").mkdir()

    def _check_room(self, target: Path) -> None:
        """Refuse before writing when the file system cannot hold another checkpoint the size of
        the newest one (the older ones are pruned only after the new one is complete). Writing
        anyway would fail deep inside megatron's writer threads, whose error loses the OSError."""
        done = sorted(p for p in self.root.glob("iter_*") if p.is_dir() and p != target)
        if not done:
            return
        need = sum(f.stat().st_size for f in done[-1].rglob("*") if f.is_file())
        if shutil.disk_usage(self.root).free < need:
            raise OSError(errno.ENOSPC, f"not enough space for a checkpoint of this run ({need / 2**20:.1f} MiB, "
                                        f"the size of {done[-1].name})")

    @staticmethod
    def _write_rng(tmp: Path) -> None:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        rng_file = tmp / "rng" / f"rank_{dist.get_rank()}.safetensors"
        save_file(rng, str(rng_file))
        fsync_path(rng_file)  # each rank flushes what it wrote (megatron fsyncs its own .distcp files)

    def _write_carry(self, tmp: Path, state: RunState) -> None:
        """Collective over each DP group: rank 0 writes every DP rank's carried groups (every rank of a
        replica holds its replica's alike), in the checkpoint beside the sampler's state."""
        plain = carry_over.to_plain(state.carry.groups)
        by_rank = [plain]
        if parallel.dp_size() > 1:
            by_rank = [None] * parallel.dp_size()
            parallel.all_gather_object(by_rank, plain, group=parallel.wait_group("data_parallel"))
        self.carried = sum(len(x) for x in by_rank)
        if parallel.is_rank0() and self.carried:
            carry_over.write_groups(tmp / carry_over.FILE, by_rank)
            fsync_path(tmp / carry_over.FILE)

    def _commit(self, tmp: Path, target: Path, state: RunState) -> None:
        """Rank 0: state.json, the rename into place, `latest`, and the pruning of old ones."""
        if not parallel.is_rank0():
            return
        meta = {"state": state.to_json(), "lr_steps": {k: m.scheduler.num_steps for k, m in self.models.items()
                                                       if m.scheduler is not None},
                "world_size": dist.get_world_size(), "config": self.config, "carried_groups": self.carried,
                "complete": True}
        (tmp / "state.json").write_text(json.dumps(meta, indent=1))
        # the same iteration again (after a fallback) replaces it
        commit_dir(tmp, target, writer="vapo-train checkpoint")
        write_atomic(self.root / "latest", target.name + "\n")
        older = sorted(p for p in self.root.glob("iter_*") if p.name < target.name)
        for old in older[: max(len(older) - (self.keep - 1), 0)]:
            dead = self.root / f".{old.name}.del"
            old.rename(dead)  # never a half-deleted iter_N
            shutil.rmtree(dead, ignore_errors=True)
        self._remove_leftovers()

    def _carried(self, path: Path, meta: dict, state: RunState) -> list:
        """This DP rank's carried groups (data/carry_over.py); the file must hold as many as state.json
        says, and groups this run can continue (carry_over.Bounds: else the first step after every
        resume failed on them, IndexError or worse)."""
        count = meta["carried_groups"] if "carried_groups" in meta else 0
        if not count:
            return []
        saved_state, rollout = meta["state"], (meta["config"] if "config" in meta else {})["rollout"]
        bounds = carry_over.Bounds(
            vocab_size=self.models["actor"].vocab_size, prompts=len(state.sampler.records),
            admitted=saved_state["carry"]["admitted"],
            version=saved_state["iteration"] - saved_state["pretrain_steps_done"],
            pretrain_iterations=saved_state["pretrain_steps_done"], n_samples=rollout["n_samples"],
            max_new_tokens=rollout["max_new_tokens"])
        try:
            saved_dp, saved = carry_over.read_groups(path / carry_over.FILE, bounds)
        except ValueError as e:
            raise CheckpointCorrupt(str(e)) from None
        if len(saved) != count:
            raise CheckpointCorrupt(f"{path / carry_over.FILE} holds {len(saved)} groups, state.json says {count}")
        if saved_dp != parallel.dp_size() and parallel.is_rank0():
            print(f"[vapo] {path}: the carried-over groups of {saved_dp} DP ranks are dealt over {parallel.dp_size()}",
                  flush=True)
        return carry_over.groups_for_rank(saved, saved_dp, parallel.dp_size(), parallel.dp_rank())

    def _rng_state(self, path: Path, meta: dict) -> dict | None:
        """This rank's RNG state; None when the checkpoint was written by another world size (then
        the RNG is not restored)."""
        if meta["world_size"] != dist.get_world_size():
            return None
        rng_file = path / "rng" / f"rank_{dist.get_rank()}.safetensors"
        if not rng_file.is_file():
            raise CheckpointCorrupt(f"{rng_file} is missing")
        return load_file(str(rng_file))

    def _check_matches(self, path: Path) -> None:
        """Collective: raise CheckpointMismatch on every rank when any rank's part of a model
        differs in shape from the checkpoint (each rank holds only its pipeline stage's layers)."""
        for sub, model in self.models.items():
            with model.layout:  # each model's shards at its own layout (the critic's may differ)
                found = dist_io.shape_mismatches(path / sub, dist_io.model_sharded_state(model.modules),
                                                 vocab_size=model.hf_cfg["vocab_size"])
            everyone = [[] for _ in range(dist.get_world_size())]
            parallel.all_gather_object(everyone, found)
            found = sorted({f for rank in everyone for f in rank})
            if found:
                more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
                raise CheckpointMismatch(
                    f"{path / sub} holds another model than the one built from {model.hf_dir}: "
                    f"{'; '.join(found[:3])}{more}. "
                    f"Resume with the model the run was started with ({path / sub / 'hf' / 'config.json'}), "
                    "or choose a new trainer.run_dir; the checkpoints are intact")

    def _check_layout(self, path: Path, meta: dict) -> None:
        """Stop (older checkpoints are no better) when an optimizer's state cannot load here: at this
        layout, or into this kind of optimizer. The format is the one the checkpoint records, not
        the one this run's Adam would write."""
        for sub, model in self.models.items():
            saved, now = saved_layout(meta.get("config") or {}, sub), saved_layout(self.config, sub)
            try:
                fmt = saved_optimizer_format(path / sub)
            except dist_io.CheckpointError:
                continue  # damaged: its load says so, and an older checkpoint is tried
            if has_distributed_optimizer(model) != (fmt is not None):
                raise CheckpointMismatch(
                    f"{path / sub} was written {'with' if fmt else 'without'} the distributed optimizer; resume with "
                    f"{sub}_optim.distributed_optimizer={'true' if fmt else 'false'}; the checkpoints are intact")
            if why := resume_layout_problem(fmt, saved, now):
                raise CheckpointMismatch(f"{path / sub}: {why}; the checkpoints are intact")

    def load(self, state: RunState) -> bool:
        """Resume from the newest loadable checkpoint into the models and `state`; False when the
        run directory has none.

        A damaged checkpoint (unreadable state.json, missing metadata, a truncated or missing tensor
        file, ...) is reported by name and the next older one is tried. Every rank takes the same
        decision after each step of the load: a damaged shard may be read by one rank only. When
        checkpoints exist but none loads, the run stops rather than silently starting over."""
        failures = []
        for path in candidates(self.root, say_damage=parallel.is_rank0()):
            try:
                meta = _on_every_rank(partial(check_complete, path, self.models))
                if why := ep_change(meta["config"] if "config" in meta else None, self.config):
                    raise CheckpointMismatch(f"{path} was {why}; the checkpoints are intact")
                self._check_matches(path)  # another model: stop (older checkpoints are no better)
                self._check_layout(path, meta)
                for sub, model in self.models.items():
                    _on_every_rank(at_layout(model, partial(load_model_state, model, path / sub)))
                rng = _on_every_rank(partial(self._rng_state, path, meta))
                carried = _on_every_rank(partial(self._carried, path, meta, state))
            except CheckpointCorrupt as e:
                if parallel.is_rank0():
                    print(f"[vapo] checkpoint {path} is damaged, falling back to an older one: {e}", flush=True)
                failures.append(f"{path.name}: {e}")
                continue
            if rng is not None:
                torch.set_rng_state(rng["cpu"])
                if "cuda" in rng and torch.cuda.is_available():
                    torch.cuda.set_rng_state(rng["cuda"])
            elif parallel.is_rank0():
                n = meta["world_size"]
                print(f"[vapo] {path} was written by {n} rank{'' if n == 1 else 's'}, not {dist.get_world_size()}: "
                      "random number generators are not restored (the run continues, not bitwise as before)",
                      flush=True)
            state.load_json(meta["state"])
            state.carry.groups, state.carry.drain = carried, "carried_groups" in meta and meta["carried_groups"] > 0
            # Checkpoints written before the LR schedule existed have no lr_steps: their runs had
            # a constant learning rate, so the schedule starts at 0 updates.
            steps = meta["lr_steps"] if "lr_steps" in meta else {}
            for sub, model in self.models.items():
                if model.scheduler is not None:
                    set_lr_steps(model.scheduler, steps[sub] if sub in steps else 0)
            if parallel.is_rank0():
                print(f"[vapo] resumed from {path} at iteration {state.iteration}", flush=True)
            return True
        if failures:
            raise CheckpointCorrupt(
                f"no checkpoint in {self.root} can be loaded ({'; '.join(failures)}); "
                f"move {self.root} away to start the run afresh"
            )
        return False


__all__ = ["CheckpointCorrupt", "CheckpointMismatch", "CheckpointSaveError", "CheckpointManager", "KEEP_CHECKPOINTS"]
