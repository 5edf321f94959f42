"""vapo-convert as a user types it: it never deletes what it did not write, and answers bad input
with one line and exit 2 (issue 25 items 1 and 7).

The conversion whose whole output must hold no library line runs as the real command (`python -m
vapo_megatron.convert`, one process); the other conversions that succeed run convert.main on one
rank forked from the suite's preloaded forkserver (tests/helpers/train_runs.py command_in_forks:
main's return value is the exit code, its output the command's), without an interpreter's
start-up; the refusals come before torch.distributed starts, so they run in this process through
convert.main. The user's files are compared byte for byte with what the test wrote.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.quiet_check import library_noise, users_env
from tests.helpers.tiny_hf import save_tiny, save_tiny_tokenizer
from tests.helpers.train_runs import Launch, command_in_forks

ROOT = Path(__file__).resolve().parents[2]


def convert(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vapo_megatron.convert", *map(str, args)], cwd=cwd, text=True,
                          capture_output=True, env={**users_env(), "PYTHONPATH": str(ROOT), **env}, timeout=300)


def convert_in_fork(*args: str) -> Launch:
    return command_in_forks("vapo_megatron.convert", list(map(str, args)))


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def refused(capsys, *argv: str) -> str:
    """convert.main's answer to bad input: exit 2, one "vapo-convert: error:" line (followed by one
    "  - " line per problem when it lists several), no traceback. Returns that message."""
    from vapo_megatron import convert as cli

    code = cli.main(list(map(str, argv)))
    err = capsys.readouterr().err
    lines = err.replace("\r", "\n").splitlines()
    ours = [i for i, line in enumerate(lines) if line.startswith("vapo-convert")]
    assert code == 2 and len(ours) == 1 and lines[ours[0]].startswith("vapo-convert: error: "), err
    assert "Traceback" not in err, err
    listed = [line for line in lines[ours[0] + 1:] if line.startswith("  - ")]
    return "\n".join([lines[ours[0]], *listed])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny HF model and its hf-to-mcore checkpoint (written by the real command)."""
    root = tmp_path_factory.mktemp("cli")
    save_tiny(root / "hf", seed=5)
    save_tiny_tokenizer(root / "hf")
    run = convert_in_fork("hf-to-mcore", "--hf", root / "hf", "--out", root / "mc")
    assert run.returncode == 0, run.stderr[-3000:]
    return root


def test_out_dot_in_a_project_directory_keeps_the_project(made, tmp_path, capsys, monkeypatch):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "notes.md").write_text("three weeks of notes\n")
    (project / "src" / "train.py").write_bytes(b"import os\n\x00")
    before = snapshot(project)
    monkeypatch.chdir(project)
    line = refused(capsys, "mcore-to-hf", "--ckpt", made / "mc", "--out", ".")
    assert "--out . is a non-empty directory" in line and "choose another --out" in line and "--overwrite" in line
    line = refused(capsys, "mcore-to-hf", "--ckpt", made / "mc", "--out", ".", "--overwrite")  # not vapo-convert's
    assert "never replaces" in line
    assert snapshot(project) == before and sorted(p.name for p in tmp_path.iterdir()) == ["project"]


def test_the_source_is_never_the_output(made, capsys):
    before = snapshot(made / "hf")
    assert f"--out {made / 'hf'} is the input --hf" in refused(capsys, "hf-to-mcore", "--hf", made / "hf", "--out",
                                                               made / "hf")
    assert "holds the input --hf" in refused(capsys, "hf-to-mcore", "--hf", made / "hf", "--out", made, "--overwrite")
    assert "lies inside the input --ckpt" in refused(capsys, "mcore-to-hf", "--ckpt", made / "mc", "--out",
                                                     made / "mc" / "x")
    assert snapshot(made / "hf") == before


def test_overwrite_replaces_only_the_same_directions_output(made, tmp_path, capsys):
    out = tmp_path / "again"
    shutil.copytree(made / "mc", out)  # an earlier output of the same command, as the fixture's command wrote it
    line = refused(capsys, "hf-to-mcore", "--hf", made / "hf", "--out", out)
    assert f"--out {out} holds an earlier output of vapo-convert hf-to-mcore; pass --overwrite" in line
    line = refused(capsys, "mcore-to-hf", "--ckpt", made / "mc", "--out", out, "--overwrite")
    assert "written by vapo-convert hf-to-mcore, which vapo-convert mcore-to-hf never replaces" in line
    (out / "stale.txt").write_text("from the earlier output")
    run = convert_in_fork("hf-to-mcore", "--hf", made / "hf", "--out", out, "--overwrite")
    assert run.returncode == 0, run.stderr[-3000:]
    assert not (out / "stale.txt").exists() and (out / "metadata.json").is_file()


def test_a_trainer_iteration_converts_its_actor(made, tmp_path):
    it = tmp_path / "run" / "checkpoints" / "iter_0000010"
    it.mkdir(parents=True)
    shutil.copytree(made / "mc", it / "actor")
    (it / "state.json").write_text(json.dumps({"state": {"iteration": 10}, "complete": True}))
    run = convert("mcore-to-hf", "--ckpt", it, "--out", tmp_path / "hf")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{it} is a trainer checkpoint: converting its actor, {it / 'actor'}" in run.stderr
    noise = library_noise(run.stdout + run.stderr)  # loading a dist checkpoint printed torch's warnings once
    assert not noise, noise
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_run_checkpoints_directory_names_the_form_to_give(made, tmp_path, capsys):
    it = tmp_path / "checkpoints" / "iter_0000010"
    it.mkdir(parents=True)
    line = refused(capsys, "mcore-to-hf", "--ckpt", tmp_path / "checkpoints", "--out", tmp_path / "hf")
    assert f"is a run's checkpoints directory; give one checkpoint's model, e.g. --ckpt {it / 'actor'}" in line


def test_bad_input_is_one_line(made, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert f"{tmp_path / 'empty'} has no config.json" in refused(capsys, "hf-to-mcore", "--hf", tmp_path / "empty",
                                                                 "--out", tmp_path / "o")
    neox = tmp_path / "neox"
    shutil.copytree(made / "hf", neox)
    cfg = json.loads((neox / "config.json").read_text())
    (neox / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPTNeoXForCausalLM"],
                                                  "model_type": "gpt_neox"}))
    assert "unsupported architecture" in refused(capsys, "hf-to-mcore", "--hf", neox, "--out", tmp_path / "o")
    line = refused(capsys, "hf-to-mcore", "--hf", made / "hf", "--out", tmp_path / "o", "--tp", "3")
    assert "--tp=3 does not divide num_attention_heads=4" in line and "does not divide the world size 1" in line
    assert "does not divide the world size 1" in refused(capsys, "mcore-to-hf", "--ckpt", made / "mc", "--out",
                                                          tmp_path / "o", "--tp", "2")
    (tmp_path / "file").write_text("x")
    assert "which is a file" in refused(capsys, "hf-to-mcore", "--hf", made / "hf", "--out", tmp_path / "file" / "o")
    assert not (tmp_path / "o").exists()


def test_verbose_adds_the_traceback(tmp_path, capsys, monkeypatch):
    from vapo_megatron import convert as cli

    (tmp_path / "empty").mkdir()
    argv = ["hf-to-mcore", "--hf", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]
    monkeypatch.delenv("VAPO_VERBOSE", raising=False)
    assert cli.main(argv) == 2
    quiet = capsys.readouterr().err
    monkeypatch.setenv("VAPO_VERBOSE", "1")
    assert cli.main(argv) == 2
    loud = capsys.readouterr().err
    assert "Traceback" not in quiet and "Traceback" in loud
    assert f"vapo-convert: error: {tmp_path / 'empty'} has no config.json" in loud
