"""Atomic, durable writes: the one helper every writer of the project uses.

    write_atomic(path, data)        a file: temp file beside it, flushed, fsynced, renamed, dir fsynced
    staging_path(target)            where `target` is built: `.<name>.tmp` beside it (every rank agrees)
    staging_dir(target)             that directory, created empty (one rank)
    commit_dir(tmp, target)         the built directory flushed to disk, then renamed into place
    fsync_tree(root)                every file and directory below `root` flushed to disk

The rename is the commit: a reader sees the old content or the new, never a part; and because
the data is flushed before the rename and the directory after it, a power loss cannot leave the
new name pointing at data that never reached the disk. Pure Python (no torch).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """Flush one file or directory to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """Flush a directory tree's files and directories (before it is renamed into place)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fsync_path(Path(dirpath) / f)
        fsync_path(dirpath)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Replace `path` with `data` atomically and durably; returns `path`."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
    return path


def staging_path(target: str | Path) -> Path:
    """`.<name>.tmp` beside `target`: where a directory is built before commit_dir."""
    target = Path(target).absolute()
    return target.parent / f".{target.name}.tmp"


def staging_dir(target: str | Path) -> Path:
    """A fresh, empty staging_path(target) (a leftover of a crashed write is removed)."""
    tmp = staging_path(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: str | Path, target: str | Path) -> Path:
    """Flush `tmp`, then put it in place of `target`. An existing `target` is first renamed to
    `.<name>.old` and removed only once the new one is in place, so at every moment one complete
    directory is at `target` or beside it."""
    tmp, target = Path(tmp), Path(target).absolute()
    fsync_tree(tmp)
    old = target.parent / f".{target.name}.old"
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    os.replace(tmp, target)
    fsync_path(target.parent)
    shutil.rmtree(old, ignore_errors=True)
    return target


__all__ = ["commit_dir", "fsync_path", "fsync_tree", "staging_dir", "staging_path", "write_atomic"]
