"""One trainer per run directory: an exclusive lock on it, and workers that die with their launcher.

    die_with_launcher()         first thing in a torchrun worker: the kernel kills it when the agent dies
    lock = RunDirLock.acquire(run_dir)   collective: rank 0 locks run_dir/.vapo-lock, or every rank raises
    remove_unused_run_dir(run_dir)       a start refused after it made run_dir leaves nothing behind

Why both. torchrun starts each worker in a session of its own, so `kill -9` of the launcher's
process group (or of torchrun alone) used to leave the workers running, re-parented to init,
training and writing checkpoints for minutes. And nothing stopped the user's natural next step,
the same command again, from starting a second trainer on the same checkpoints and metrics.

The lock is a POSIX record lock (fcntl.lockf), held by global rank 0's process for its life:
- the kernel drops it when that process dies, however it dies, so a crash never leaves a stale lock;
- unlike flock(), it is not inherited by children forked later (helper processes that outlive
  the trainer would otherwise keep the run directory locked);
- it works on NFS and Lustre, where run directories of a Slurm cluster live.
The lock file also holds the holder's host and pid, for the refusal's message.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import sys
import time
from pathlib import Path

from vapo_megatron.config.schema import ConfigError

LOCK_FILE = ".vapo-lock"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class RunDirLocked(ConfigError):
    """Another trainer holds the run directory; the message names its host and pid."""


def die_with_launcher() -> bool:
    """Under torchrun: ask the kernel to SIGKILL this worker when its parent (the elastic agent)
    dies, so that no orphan keeps training after the launcher was killed. SIGKILL, not SIGTERM:
    with the launcher gone nobody waits for this run, and checkpoints are written atomically
    (a cut save leaves the previous one). Returns whether it is armed (Linux, under torchrun)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if armed and os.getppid() != parent:  # the agent died before the request was in place
        os._exit(1)
    return armed


class RunDirLock:
    """Held by global rank 0 while the trainer runs; the other ranks hold nothing."""

    def __init__(self, fd: int | None):
        self.fd = fd

    @classmethod
    def acquire(cls, run_dir: str | Path, *, rank0: bool, share) -> "RunDirLock":
        """Collective. Rank 0 takes the lock, or reads who holds it; `share(obj)` gives every rank
        rank 0's finding (a broadcast), so that all of them refuse together with RunDirLocked."""
        fd, holder = None, ""
        if rank0:
            fd, holder = _try_lock(Path(run_dir))
        holder = share(holder)
        if holder:
            raise RunDirLocked(
                f"trainer.run_dir={run_dir} is in use by another trainer ({holder}; lock file "
                f"{Path(run_dir) / LOCK_FILE}). Wait for it to finish or stop it, or choose another trainer.run_dir"
            )
        return cls(fd)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the record lock
            self.fd = None


def remove_unused_run_dir(run_dir: str | Path) -> None:
    """Remove a run directory that holds nothing but its lock file (a start refused after taking
    the lock, in a directory it made): a refusal leaves nothing behind. Anything else stays."""
    run_dir = Path(run_dir)
    try:
        if {p.name for p in run_dir.iterdir()} <= {LOCK_FILE}:
            (run_dir / LOCK_FILE).unlink(missing_ok=True)
            run_dir.rmdir()
    except OSError:
        pass  # another process wrote into it meanwhile, or it is gone: leave it


def _try_lock(run_dir: Path) -> tuple[int | None, str]:
    """(fd holding the lock, "") or (None, a description of the holder)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        try:
            text = path.read_text().strip()  # written by the holder once it had the lock
        except OSError:
            text = ""
        return None, text or "holder unknown"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {stamp}\n".encode(), 0)
    return fd, ""


__all__ = ["LOCK_FILE", "RunDirLock", "RunDirLocked", "die_with_launcher", "remove_unused_run_dir"]
