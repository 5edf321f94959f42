"""Atomic, durable writes: the one helper every writer of the project uses.

    write_atomic(path, data)        a file: temp file beside it, flushed, fsynced, renamed, dir fsynced
    staging_path(target)            where `target` is built: `.<name>.tmp` beside it, or inside an
                                    empty existing `target` (every rank agrees)
    staging_dir(target)             that directory, created empty (one rank)
    commit_dir(tmp, target, writer=W)  the built directory, marked as W's, its modes the umask's,
                                    flushed, put in place
    fsync_tree(root)                every file and directory below `root` flushed to disk
    check_replaceable(target, W, overwrite=...)   may W put a directory at `target`? (before any work)
    can_create_in(directory)        whether a file can be created there, tried for real
    writer_of(path)                 who wrote a directory: its marker, or a legacy trainer layout

The rename is the commit: a reader sees the old content or the new, never a part; and because
the data is flushed before the rename and the directory after it, a power loss cannot leave the
new name pointing at data that never reached the disk. An EMPTY existing target is never renamed
(a mount point or a container volume cannot be: EBUSY, after all the work): it is built inside
itself, in IN_PLACE, whose entries are then moved up one by one, the files that make a directory
readable (a dist checkpoint's metadata.json, a model's config.json) and the marker last, so that a
reader never takes a part for the whole. Pure Python (no torch).

Ownership: a directory is replaced only by the writer that wrote it. Every committed directory
carries MARKER (`.vapo-writer`, JSON naming its writer, e.g. "vapo-convert hf-to-mcore");
`--out .` or `--out ~` once made vapo-convert rename a project or home directory away and delete
it. check_replaceable is the rule the commands apply up front (one clear TargetRefused line);
commit_dir applies it again as a safety net, so no caller can delete what it did not write.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import time
from pathlib import Path

MARKER = ".vapo-writer"
# Writers (the marker's "writer" field); each replaces only its own directories.
TRAINER_CHECKPOINT = "vapo-train checkpoint"
TRAINER_EXPORT = "vapo-train export"
TRAINER_TRUNK = "vapo-train critic trunk"  # the policy's trunk on its way to a critic at another layout
CONVERT_HF_TO_MCORE = "vapo-convert hf-to-mcore"
CONVERT_MCORE_TO_HF = "vapo-convert mcore-to-hf"
EVAL_OUTPUT = "vapo-eval"  # files written into --out, replaced by the next vapo-eval there
IN_PLACE = ".vapo-staging"  # where an empty existing target is built: inside itself
# Moved into an empty target last, in this order: what makes it a checkpoint, a model, the writer's.
LAST = ("metadata.json", "config.json", MARKER)


class TargetRefused(ValueError):
    """A directory that a writer may not replace (not its own, or the source of its input); the
    message names the path, what is there and how to proceed."""


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


def process_umask() -> int:
    """This process's umask, read without changing it (/proc on Linux; elsewhere set and restored)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(root: str | Path) -> None:
    """Give every file and directory below `root` the mode a plain open() or mkdir() gives under
    the umask (files 0o666, executables and directories 0o777, less the umask). Some writers create
    their files 0600 (safetensors' save_file): an exported model would be unreadable to the other
    users of a shared cluster while every other file of the run is readable."""
    mask = process_umask()
    for dirpath, dirs, files in os.walk(root):
        for path, full in [(dirpath, True)] + [(os.path.join(dirpath, f), False) for f in files]:
            st = os.lstat(path)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                continue  # a link keeps its target's mode
            want = (0o777 if full or st.st_mode & 0o111 else 0o666) & ~mask
            if st.st_mode & 0o777 != want:
                try:
                    os.chmod(path, want)
                except OSError:  # another user's file: its mode stays (cosmetic, never a reason to fail a save)
                    pass


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


def empty_dir(path: str | Path) -> bool:
    """An existing directory (not a link) holding nothing, or only a leftover IN_PLACE staging
    directory of a write that did not finish."""
    path = Path(path)
    try:
        return path.is_dir() and not path.is_symlink() and all(p.name == IN_PLACE for p in path.iterdir())
    except OSError:
        return False


def staging_path(target: str | Path) -> Path:
    """Where a directory is built before commit_dir: inside `target` (IN_PLACE) when it is an empty
    existing directory, which is then filled in place and never renamed; else `.<name>.tmp` beside it."""
    target = Path(target).absolute()
    if empty_dir(target):
        return target / IN_PLACE
    return target.parent / f".{target.name}.tmp"


def staging_dir(target: str | Path) -> Path:
    """A fresh, empty staging_path(target) (a leftover of a crashed write is removed)."""
    tmp = staging_path(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def mark(directory: str | Path, writer: str) -> None:
    """Name `writer` as the author of `directory` (the marker check_replaceable reads)."""
    (Path(directory) / MARKER).write_text(json.dumps({"writer": writer, "host": socket.gethostname(),
                                                      "pid": os.getpid(),
                                                      "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")


def commit_dir(tmp: str | Path, target: str | Path, *, writer: str) -> Path:
    """Mark `tmp` as `writer`'s, flush it, then put it in place of `target`. An existing `target`
    is first renamed to `.<name>.old` and removed only once the new one is in place, so at every
    moment one complete directory is at `target` or beside it. An empty `target` (`tmp` is its
    IN_PLACE) is filled in place instead (fill_in_place). An existing non-empty `target` that
    `writer` did not write is never touched: TargetRefused (and `tmp` is left to the caller,
    whose error path removes it)."""
    tmp, target = Path(tmp), Path(target).absolute()
    check_replaceable(target, writer, overwrite=True, flag=None, key="")
    mark(tmp, writer)
    follow_umask(tmp)
    fsync_tree(tmp)
    if tmp == target / IN_PLACE:
        return fill_in_place(tmp, target)
    old = target.parent / f".{target.name}.old"
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    os.replace(tmp, target)
    fsync_path(target.parent)
    shutil.rmtree(old, ignore_errors=True)
    return target


def fill_in_place(tmp: Path, target: Path) -> Path:
    """Move the flushed entries of `tmp` (target/IN_PLACE) up into the empty `target`, which keeps
    its name and inode. The entries in LAST go last, after a flush of the rest: until metadata.json
    or config.json is there no reader takes the directory for a checkpoint or a model, and until
    the marker is there no writer takes it for its own (a cut move is refused, naming IN_PLACE)."""
    names = sorted(os.listdir(tmp), key=lambda n: (LAST.index(n) + 1 if n in LAST else 0, n))
    for i, name in enumerate(names):
        if name in LAST and (i == 0 or names[i - 1] not in LAST):
            fsync_path(target)
        os.rename(tmp / name, target / name)
    tmp.rmdir()
    fsync_path(target)
    return target


def _legacy_writer(path: Path) -> str | None:
    """The writer of a directory committed before markers existed, recognised by what only that
    writer leaves: a trainer checkpoint (iter_N/state.json with the trainer's "state" and
    "complete" entries) or the trainer's final export (run_dir/hf beside run_dir/config.yaml,
    holding an index whose shards all carry hf_write's model-ppNNN- names). vapo-convert's old
    outputs are not guessed: they are refused, and the user removes them by hand."""
    try:
        if path.name.startswith("iter_") and (path / "state.json").is_file():
            meta = json.loads((path / "state.json").read_text())
            if isinstance(meta, dict) and "state" in meta and "complete" in meta:
                return TRAINER_CHECKPOINT
        index = path / "model.safetensors.index.json"
        if path.name == "hf" and (path.parent / "config.yaml").is_file() and index.is_file():
            shards = set(json.loads(index.read_text())["weight_map"].values())
            if shards and all(s.startswith("model-pp") and s.endswith(".safetensors") for s in shards):
                return TRAINER_EXPORT
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return None


def writer_of(path: str | Path) -> str | None:
    """Who wrote the directory `path`: its marker's writer, else a recognised legacy layout's,
    else None (not the project's, or unreadable)."""
    path = Path(path)
    try:
        writer = json.loads((path / MARKER).read_text()).get("writer")
        return writer if isinstance(writer, str) else None
    except FileNotFoundError:
        return _legacy_writer(path)
    except (OSError, ValueError, AttributeError):
        return None


def _within(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def check_replaceable(target: str | Path, writer: str, *, overwrite: bool, flag: str | None = "--overwrite",
                      key: str = "--out", sources: dict[str, str | Path] | None = None, in_place: bool = False) -> None:
    """May `writer` put a new directory at `target`? Yes when nothing is there, when an empty
    directory is, or, with `overwrite`, when `writer` itself wrote what is there. Anything else,
    and a `target` that is, holds or lies inside one of `sources` ({flag: path} of the inputs),
    raises TargetRefused naming `key` (the flag or setting that chose `target`; "" for none), what
    is there and how to go on (`flag`: the option that allows replacing; None when there is none).
    What the write needs of the file system is tried too, now rather than at the end: new files in
    the directory it creates them in (the target itself when it exists and is empty, or with
    `in_place`: a writer of files into it, vapo-eval; else the parent, where a replacement is built
    before the rename), and a target that can be renamed (not a mount point)."""
    name = f"{key} {target}" if key else str(target)
    other = f"choose another {key}" if key else "move it away"
    target = Path(target).expanduser().absolute()
    real = target.resolve()
    for src_key, src in (sources or {}).items():
        src = Path(src).expanduser().resolve()
        if _within(real, src) or _within(src, real):
            where = "is" if real == src else ("holds" if _within(src, real) else "lies inside")
            raise TargetRefused(f"{name} {where} the input {src_key} {src}: writing there would destroy or "
                                f"change the input; {other}")
    if not target.exists() and not target.is_symlink():
        above = next((p for p in target.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            raise TargetRefused(f"{name} lies under {above}, which is a file, not a directory; {other}")
        if above is not None and not can_create_in(above):
            raise TargetRefused(f"{name} cannot be written: nothing can be created in {above}; {other}")
        return
    if target.is_symlink() or not target.is_dir():
        raise TargetRefused(f"{name} exists and is not a directory that {writer} wrote; {other}")
    unwritable = f"{name} cannot be written: nothing can be created in it (read-only?); {other}"
    if empty_dir(target):  # written into, never renamed
        if not can_create_in(target):
            raise TargetRefused(unwritable)
        return
    found = writer_of(target)
    if found == writer:
        if not overwrite:
            raise TargetRefused(f"{name} holds an earlier output of {writer}; pass {flag} to replace it, or {other}")
        if in_place:
            if not can_create_in(target):
                raise TargetRefused(unwritable)
            return
        if not can_create_in(target.parent):  # the new directory is staged beside the target, then renamed
            raise TargetRefused(f"{name} cannot be replaced: nothing can be created in {target.parent}; {other}")
        if os.path.ismount(target):
            raise TargetRefused(f"{name} is a mount point, which cannot be renamed away to be replaced; empty it (an "
                                f"empty directory is written in place), or {other}")
        return
    if (target / IN_PLACE).is_dir():
        what = f"a directory that a write cut short left half-filled ({IN_PLACE} is still in it)"
    else:
        what = (f"a directory written by {found}" if found else
                f"a non-empty directory without a {MARKER} marker (not written by vapo-megatron, or by a version "
                "before markers)")
    allowed = f" ({flag} replaces only a directory that {writer} wrote)" if flag else ""
    raise TargetRefused(f"{name} is {what}, which {writer} never replaces; {other}{allowed}")


def can_create_in(directory: Path) -> bool:
    """Whether a file can be created in `directory`, tried for real: os.access says yes to root
    on directories it cannot write (/proc, a read-only mount)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


__all__ = ["CONVERT_HF_TO_MCORE", "CONVERT_MCORE_TO_HF", "EVAL_OUTPUT", "IN_PLACE", "LAST", "MARKER",
           "TRAINER_CHECKPOINT", "TRAINER_EXPORT", "TargetRefused", "can_create_in", "check_replaceable", "commit_dir",
           "empty_dir", "fill_in_place", "follow_umask", "fsync_path", "fsync_tree", "mark", "process_umask",
           "staging_dir", "staging_path", "write_atomic", "writer_of"]
