"""Writers replace only what they wrote (runtime/atomic.py; issue 25 item 1).

`vapo-convert ... --out .` once renamed a project directory away and deleted it. Here the rule
itself, on real directories: commit_dir never touches a directory another writer (or the user)
made, and check_replaceable answers each case with one line naming the path and the way on. The
user's files are compared byte for byte with what the test wrote, not with the code's view.
"""

from __future__ import annotations

import json
import os

import pytest

from vapo_megatron.runtime.atomic import (
    CONVERT_HF_TO_MCORE,
    CONVERT_MCORE_TO_HF,
    EVAL_OUTPUT,
    MARKER,
    TRAINER_CHECKPOINT,
    TRAINER_EXPORT,
    TargetRefused,
    check_replaceable,
    commit_dir,
    staging_dir,
    writer_of,
)


def user_dir(path):
    """A directory of the user's: a notes file and a source file below it."""
    (path / "src").mkdir(parents=True)
    (path / "notes.txt").write_bytes(b"my notes\x00\xff")
    (path / "src" / "main.py").write_text("print('hi')\n")
    return {"notes.txt": b"my notes\x00\xff", "src/main.py": b"print('hi')\n"}


def unchanged(path, files) -> bool:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()} == files


def built(target, name="weights.bin"):
    tmp = staging_dir(target)
    (tmp / name).write_bytes(b"new")
    return tmp


def test_commit_dir_never_replaces_a_users_directory(tmp_path):
    target = tmp_path / "project"
    files = user_dir(target)
    tmp = built(target)
    with pytest.raises(TargetRefused, match=f"{target} is a non-empty directory without a {MARKER} marker"):
        commit_dir(tmp, target, writer=CONVERT_MCORE_TO_HF)
    assert unchanged(target, files)
    assert not (tmp_path / ".project.old").exists()


def test_commit_dir_marks_and_replaces_its_own(tmp_path):
    target = tmp_path / "out"
    commit_dir(built(target, "a"), target, writer=CONVERT_HF_TO_MCORE)
    assert json.loads((target / MARKER).read_text())["writer"] == CONVERT_HF_TO_MCORE
    assert writer_of(target) == CONVERT_HF_TO_MCORE
    commit_dir(built(target, "b"), target, writer=CONVERT_HF_TO_MCORE)
    assert sorted(p.name for p in target.iterdir()) == [MARKER, "b"]
    with pytest.raises(TargetRefused, match=f"written by {CONVERT_HF_TO_MCORE}, which {CONVERT_MCORE_TO_HF} never"):
        commit_dir(built(target, "c"), target, writer=CONVERT_MCORE_TO_HF)  # the other direction's output
    assert sorted(p.name for p in target.iterdir()) == [MARKER, "b"]


def test_new_and_empty_targets_are_allowed(tmp_path):
    check_replaceable(tmp_path / "new" / "deeper", CONVERT_HF_TO_MCORE, overwrite=False)
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty", CONVERT_HF_TO_MCORE, overwrite=False)


def test_an_earlier_output_needs_overwrite(tmp_path):
    target = tmp_path / "out"
    commit_dir(built(target), target, writer=CONVERT_HF_TO_MCORE)
    with pytest.raises(TargetRefused, match=f"--out {target} holds an earlier output of {CONVERT_HF_TO_MCORE}; "
                                            "pass --overwrite to replace it"):
        check_replaceable(target, CONVERT_HF_TO_MCORE, overwrite=False)
    check_replaceable(target, CONVERT_HF_TO_MCORE, overwrite=True)


@pytest.mark.parametrize("relation", ["is", "holds", "lies inside"])
def test_the_input_is_never_the_output(tmp_path, relation):
    src = tmp_path / "model"
    src.mkdir()
    out = {"is": src, "holds": tmp_path, "lies inside": src / "mcore"}[relation]
    with pytest.raises(TargetRefused, match=f"--out {out} {relation} the input --hf {src}"):
        check_replaceable(out, CONVERT_HF_TO_MCORE, overwrite=True, sources={"--hf": src})


def test_files_symlinks_and_paths_under_files_are_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(TargetRefused, match="exists and is not a directory"):
        check_replaceable(tmp_path / "file", CONVERT_HF_TO_MCORE, overwrite=True)
    with pytest.raises(TargetRefused, match=f"lies under {tmp_path / 'file'}, which is a file"):
        check_replaceable(tmp_path / "file" / "out", CONVERT_HF_TO_MCORE, overwrite=True)
    mine = tmp_path / "mine"
    commit_dir(built(mine), mine, writer=CONVERT_HF_TO_MCORE)
    os.symlink(mine, tmp_path / "link")
    with pytest.raises(TargetRefused, match="exists and is not a directory"):
        check_replaceable(tmp_path / "link", CONVERT_HF_TO_MCORE, overwrite=True)


def test_trainer_directories_from_before_markers_stay_replaceable(tmp_path):
    """A run started before markers existed: its iter_N and its final hf/ export carry none, yet
    the manager's same-iteration replace and the next export must still work on them."""
    ckpt = tmp_path / "run" / "checkpoints" / "iter_0000020"
    (ckpt / "actor").mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"state": {"iteration": 20}, "complete": True}))
    assert writer_of(ckpt) == TRAINER_CHECKPOINT
    commit_dir(built(ckpt), ckpt, writer=TRAINER_CHECKPOINT)
    assert writer_of(ckpt) == TRAINER_CHECKPOINT and (ckpt / "weights.bin").is_file()

    (tmp_path / "run" / "config.yaml").write_text("trainer: {}\n")
    export = tmp_path / "run" / "hf"
    export.mkdir()
    (export / "model-pp000-00000.safetensors").write_bytes(b"")
    (export / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-pp000-00000.safetensors"}}))
    assert writer_of(export) == TRAINER_EXPORT
    commit_dir(built(export), export, writer=TRAINER_EXPORT)
    # ... but a state.json of the user's own is not a checkpoint, and convert's old outputs are not guessed.
    other = tmp_path / "iter_notes"
    other.mkdir()
    (other / "state.json").write_text("[1, 2]")
    assert writer_of(other) is None


def test_preflight_says_at_start_that_run_dir_hf_is_not_the_trainers(tmp_path):
    from vapo_megatron.config import Config, TrainerConfig
    from vapo_megatron.config.preflight import export_problems

    run_dir = tmp_path / "run"
    files = user_dir(run_dir / "hf")
    (problem,) = export_problems(Config(trainer=TrainerConfig(run_dir=str(run_dir))))
    assert (problem.startswith(f"trainer.run_dir: {run_dir / 'hf'} is a non-empty directory")
            and "move it away" in problem)
    assert unchanged(run_dir / "hf", files)
    assert export_problems(Config(trainer=TrainerConfig(run_dir=str(tmp_path / "fresh")))) == []


def test_an_output_where_nothing_can_be_created_is_refused_before_any_work(tmp_path):
    """vapo-eval and vapo-convert check --out before they start (issue 33: an unwritable --out lost
    a whole evaluation). /proc takes no new files, even from root."""
    with pytest.raises(TargetRefused, match=r"--out /proc/vapo-out cannot be written: nothing can be created in /proc"):
        check_replaceable("/proc/vapo-out", EVAL_OUTPUT, overwrite=True, flag=None)


def test_committed_files_take_the_umasks_mode(tmp_path):
    """Exported weights were 0600 (safetensors' save_file creates its file so) while every other
    file of a run follows the umask: commit_dir gives every file and directory the mode that a plain
    open() or mkdir() gives under the process's umask, whatever the writer created."""
    import torch
    from safetensors.torch import save_file

    old = os.umask(0o027)  # not the usual 022: the mode must come from the umask, not be hard-coded
    try:
        (tmp_path / "reference.txt").write_text("x")  # what the kernel gives a plain file, and a directory
        (tmp_path / "reference_dir").mkdir()
        target = tmp_path / "hf"
        tmp = built(target, "config.json")
        save_file({"w": torch.zeros(2)}, str(tmp / "model-00000.safetensors"))
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "private.txt").write_text("y")
        os.chmod(tmp / "sub" / "private.txt", 0o600)
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        os.chmod(tmp / "run.sh", 0o700)
        commit_dir(tmp, target, writer=TRAINER_EXPORT)
    finally:
        os.umask(old)
    mode = lambda p: oct(p.stat().st_mode & 0o777)  # noqa: E731
    file_mode, dir_mode = mode(tmp_path / "reference.txt"), mode(tmp_path / "reference_dir")
    assert (file_mode, dir_mode) == ("0o640", "0o750")
    for name in ("config.json", "model-00000.safetensors", "sub/private.txt", MARKER):
        assert mode(target / name) == file_mode, name
    assert mode(target / "sub") == mode(target) == dir_mode
    assert mode(target / "run.sh") == dir_mode  # an executable stays executable, as far as the umask allows


def test_an_unwritable_run_dir_is_one_problem(tmp_path):
    """A run_dir where nothing can be created is said once, tried for real (os.access says yes to
    root on a read-only mount); no second problem about moving away run_dir/hf, which does not exist."""
    from vapo_megatron.config import Config, TrainerConfig
    from vapo_megatron.config.preflight import startup_problems

    for run_dir in ("/proc/vapo-run", "/proc/vapo-run/nested"):
        problems = [p for p in startup_problems(Config(trainer=TrainerConfig(run_dir=run_dir)), 1)
                    if "trainer.run_dir" in p or "/proc" in p]
        assert problems == [f"trainer.run_dir: {run_dir} cannot be created or written "
                            "(/proc is not writable)"], problems
    file_run_dir = tmp_path / "a_file"
    file_run_dir.write_text("")
    problems = [p for p in startup_problems(Config(trainer=TrainerConfig(run_dir=str(file_run_dir / "run"))), 1)
                if "trainer.run_dir" in p]
    assert problems == [f"trainer.run_dir: {file_run_dir / 'run'} cannot be created or written "
                        f"({file_run_dir} is a file, not a directory)"]


def busy_when_renamed(monkeypatch, mount):
    """os.rename and os.replace answer for `mount` as for a mount point (EBUSY); the moves made are
    recorded, each as (source name, destination)."""
    import errno

    moves, rename, replace = [], os.rename, os.replace

    def guarded(real):
        def move(src, dst, *a, **kw):
            if mount in (os.path.abspath(src), os.path.abspath(dst)):
                raise OSError(errno.EBUSY, "Device or resource busy", str(src))
            moves.append((os.path.basename(src), os.path.abspath(dst)))
            return real(src, dst, *a, **kw)
        return move

    monkeypatch.setattr(os, "rename", guarded(rename))
    monkeypatch.setattr(os, "replace", guarded(replace))
    return moves


def test_an_empty_target_is_filled_in_place_and_never_renamed(tmp_path, monkeypatch):
    """An empty --out that is a mount point (a scratch mount, a container volume) cannot be renamed:
    commit_dir once tried, after the whole conversion (issue 44 item 1). It is built inside itself
    and filled in place, the files that make it readable last."""
    target = tmp_path / "mnt"
    target.mkdir()
    inode = target.stat().st_ino
    moves = busy_when_renamed(monkeypatch, str(target))
    tmp = built(target, "model.safetensors")
    (tmp / "config.json").write_text("{}")
    (tmp / "hf").mkdir()
    (tmp / "hf" / "tokenizer.json").write_text("{}")
    commit_dir(tmp, target, writer=CONVERT_MCORE_TO_HF)  # once: EBUSY, renaming the mount away
    assert sorted(p.name for p in target.iterdir()) == [MARKER, "config.json", "hf", "model.safetensors"]
    assert target.stat().st_ino == inode and writer_of(target) == CONVERT_MCORE_TO_HF
    assert (target / "hf" / "tokenizer.json").read_text() == "{}" and os.listdir(tmp_path) == ["mnt"]
    assert [name for name, dst in moves if os.path.dirname(dst) == str(target)][-2:] == ["config.json", MARKER]


def test_a_write_cut_short_in_place_is_named(tmp_path):
    target = tmp_path / "mnt"
    (target / ".vapo-staging").mkdir(parents=True)
    check_replaceable(target, CONVERT_HF_TO_MCORE, overwrite=False)  # only a leftover: still empty
    (target / "common.pt").write_bytes(b"x")
    with pytest.raises(TargetRefused, match=r"a write cut short left half-filled \(.vapo-staging is still in it\)"):
        check_replaceable(target, CONVERT_HF_TO_MCORE, overwrite=True)


def test_what_the_write_needs_of_the_file_system_is_tried_first(tmp_path, monkeypatch):
    """An empty --out where nothing can be created (a read-only mount; root ignores mode bits, so the
    file system's answer is simulated) was checked only in its parent: vapo-eval evaluated, then
    failed with EROFS (issue 44 item 2). An earlier output on a mount point cannot be renamed away."""
    import errno
    import tempfile

    ro = tmp_path / "ro"
    ro.mkdir()
    real = tempfile.TemporaryFile

    def temporary_file(*a, dir=None, **kw):
        if dir is not None and os.path.abspath(dir) == str(ro):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "TemporaryFile", temporary_file)
    for writer, in_place in ((EVAL_OUTPUT, True), (CONVERT_HF_TO_MCORE, False)):
        with pytest.raises(TargetRefused, match=f"--out {ro} cannot be written: nothing can be created in it"):
            check_replaceable(ro, writer, overwrite=True, flag=None, in_place=in_place)
    (ro / "summary.json").write_text("{}")  # an earlier vapo-eval's output, now read-only
    (ro / MARKER).write_text(json.dumps({"writer": EVAL_OUTPUT}))
    with pytest.raises(TargetRefused, match=f"--out {ro} cannot be written"):
        check_replaceable(ro, EVAL_OUTPUT, overwrite=True, flag=None, in_place=True)

    mine = tmp_path / "mine"
    commit_dir(built(mine), mine, writer=CONVERT_HF_TO_MCORE)
    monkeypatch.setattr(os.path, "ismount", lambda p: os.path.abspath(p) == str(mine))
    with pytest.raises(TargetRefused, match=f"--out {mine} is a mount point, which cannot be renamed away"):
        check_replaceable(mine, CONVERT_HF_TO_MCORE, overwrite=True)
