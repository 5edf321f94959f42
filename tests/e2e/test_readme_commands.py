"""The README's commands work as written on a fresh clone after `make demo` (issue 25 item 8).

Every command line of README.md's code blocks (indented by four spaces; `\\` continues a line)
that starts with vapo-train, vapo-convert, vapo-plan, vapo-eval or torchrun is found and each is
run as written, from a directory that looks like the clone after `make demo`:
- configs/ is the repository's; runs/demo/data is what `make demo` writes
  (scripts/make_demo_data.py, seed 0), runs/chain/data what the chain task's command writes
  (`make_demo_data.py --task chain`, fewer prompts: only the files' presence is checked), and
  runs/demo/config.yaml is the configuration scripts/run_demo.sh starts the demo with (its
  overrides are read from the script itself);
- runs/demo/checkpoints/iter_0000210/actor, the demo's last actor, is stood in for by the demo
  model converted with hf-to-mcore (training it takes minutes);
- Qwen2.5-7B-Instruct/ (a model to download) is the demo's tiny model, copied.
What each command is allowed to cost decides how far it runs:
- vapo-convert and vapo-plan run completely, each process of a command forked from the suite's
  preloaded forkserver (a torchrun line: the README's process count, each with what torchrun gives
  a worker); a line with `...` gets the checkpoint and output of the lines
  before it;
- vapo-train and vapo-eval run their start-up checks exactly as the command does (vapo-train:
  train.checked_config under the launcher's RANK/WORLD_SIZE, every check a run makes before
  it builds anything, the saved configuration of runs/demo included; vapo-eval: its argument
  checks and the --model it names), then stop: a run trains for minutes;
- the `torchrun ... -m vapo_megatron.eval --engine sglang` line needs GPUs: not run here.
A README command of a new kind fails the test until this file learns it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shlex
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ("vapo-train", "vapo-convert", "vapo-plan", "vapo-eval", "torchrun")
MODULES = {"vapo_megatron.train": "vapo-train", "vapo_megatron.convert": "vapo-convert",
           "vapo_megatron.eval": "vapo-eval", "vapo_megatron.plan": "vapo-plan"}
DEMO_ACTOR = "runs/demo/checkpoints/iter_0000210/actor"
DOWNLOADED_MODEL = "Qwen2.5-7B-Instruct"


def readme_commands() -> list[list[str]]:
    """Each command of README.md's code blocks, split as a shell would (comments dropped)."""
    out, pending = [], ""
    for line in (ROOT / "README.md").read_text().splitlines():
        if not line.startswith("    ") and not pending:
            continue
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        words = shlex.split(text, comments=True)
        if words and words[0] in PROGRAMS:
            out.append(words)
    return out


def launch(words: list[str]) -> tuple[int | None, str, list[str]]:
    """(torchrun's --nproc-per-node or None, the command's name, its own arguments)."""
    if words[0] != "torchrun":
        return None, words[0], words[1:]
    i = words.index("-m")
    nproc = int(words[words.index("--nproc-per-node") + 1])
    return nproc, MODULES[words[i + 1]], words[i + 2:]


def _command_rank(module: str, argv: list[str], cwd: str, launched: bool, out_dir: str) -> int:
    """One process of a README command: `module`'s main(ARGV) in `cwd`, as torchrun's worker when the
    line starts with torchrun (run_ranks gives RANK, WORLD_SIZE and the rendezvous), otherwise with
    no launcher's variables at all, as the plain command runs; its output in out_dir/rank{R}.{out,err}."""
    os.chdir(cwd)
    if launched:
        os.environ["LOCAL_WORLD_SIZE"] = os.environ["WORLD_SIZE"]
    else:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
    from tests.helpers.dist_utils import command_main

    return command_main(module, argv, out_dir)


def run(module: str, argv: list[str], cwd: Path, *, nproc: int | None = None) -> tuple[int, str]:
    """`python -m MODULE ARGV` in `cwd` (under torchrun with `nproc` workers when given) -> (the
    largest exit code, every process's stderr). The processes are forked from the suite's preloaded
    forkserver (tests/helpers/dist_utils.py) instead of started fresh: the same main() from the
    command line on, without the ~7 s of CPU each fresh interpreter spends importing torch,
    megatron-core and transformers (torchrun itself is tested by the trainer's launches)."""
    from tests.helpers.dist_utils import run_ranks

    with tempfile.TemporaryDirectory() as out:
        codes = run_ranks(nproc or 1, _command_rank, module, argv, str(cwd), nproc is not None, out, timeout=300)
        err = "".join(Path(out, f"rank{r}.err").read_text() for r in range(nproc or 1))
    return max(codes, key=abs), err


def demo_overrides() -> list[str]:
    """The overrides scripts/run_demo.sh gives vapo-train, with its defaults (runs/demo, seed 0)."""
    script = (ROOT / "scripts" / "run_demo.sh").read_text()
    call = script[script.index("-m vapo_megatron.train"):script.index('"$@"')].replace("\\\n", " ")
    for name, value in (("CONFIG", "configs/demo_cpu.yaml"), ("RUN", "runs/demo"), ("DATA", "runs/demo/data"),
                        ("SEED", "0")):
        call = call.replace(f"${name}", value)
    words = shlex.split(call)
    assert words[:4] == ["-m", "vapo_megatron.train", "--config", "configs/demo_cpu.yaml"], words
    return words[4:]


def run_make_demo_data(work: Path, *argv: str) -> None:
    """scripts/make_demo_data.py ARGV in `work`, in this process (a subprocess would spend most of
    its time importing torch and transformers again)."""
    spec = importlib.util.spec_from_file_location("make_demo_data", ROOT / "scripts" / "make_demo_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    here = os.getcwd()
    os.chdir(work)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            script.main(list(argv))
    finally:
        os.chdir(here)


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    work = tmp_path_factory.mktemp("clone")
    (work / "configs").symlink_to(ROOT / "configs")
    run_make_demo_data(work, "--out", "runs/demo/data", "--seed", "0")
    run_make_demo_data(work, "--task", "chain", "--out", "runs/chain/data", "--n-train", "40", "--n-eval", "40",
                       "--n-sft", "20")
    shutil.copytree(work / "runs/demo/data/model", work / DOWNLOADED_MODEL)
    code, err = run("vapo_megatron.convert", ["hf-to-mcore", "--hf", "runs/demo/data/model", "--out", DEMO_ACTOR], work)
    assert code == 0, err[-3000:]
    return work


@pytest.fixture
def demo_config(clone, monkeypatch):
    """runs/demo/config.yaml as the demo's start writes it (two ranks, the script's overrides)."""
    from vapo_megatron.config import resume
    from vapo_megatron.train import checked_config

    monkeypatch.chdir(clone)
    monkeypatch.delenv("VAPO_RUN_DIR", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    resume.save(checked_config("configs/demo_cpu.yaml", demo_overrides()))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    return clone


def test_readme_has_the_commands_this_test_runs():
    kinds = {launch(w)[1] for w in readme_commands()}
    assert kinds == {"vapo-train", "vapo-convert", "vapo-plan", "vapo-eval"}, kinds


def test_training_commands_pass_every_start_up_check(demo_config, monkeypatch):
    from vapo_megatron.config import ConfigError
    from vapo_megatron.train import checked_config

    found = 0
    for words in readme_commands():
        nproc, program, args = launch(words)
        if program != "vapo-train":
            continue
        if nproc:  # what torchrun gives rank 0
            monkeypatch.setenv("RANK", "0")
            monkeypatch.setenv("WORLD_SIZE", str(nproc))
        else:
            monkeypatch.delenv("RANK", raising=False)
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        assert args[0] == "--config", words
        try:
            checked_config(args[1], args[2:])
        except ConfigError as e:
            pytest.fail(f"README command refused: {shlex.join(words)}\n{e}")
        found += 1
    assert found == 3


def test_conversion_and_plan_commands_run_as_written(clone):
    last_ckpt = last_out = None
    found = 0
    for words in readme_commands():
        nproc, program, args = launch(words)
        if program not in ("vapo-convert", "vapo-plan"):
            continue
        if "..." in args:  # the template lines: the checkpoint and a fresh output of the lines before
            args = [{"--ckpt": last_ckpt, "--out": f"{last_out}-again"}[args[i - 1]] if a == "..." else a
                    for i, a in enumerate(args)]
        module = {"vapo-convert": "vapo_megatron.convert", "vapo-plan": "vapo_megatron.plan"}[program]
        code, err = run(module, args, clone, nproc=nproc)
        assert code == 0, f"README command failed: {shlex.join(words)}\n{err[-3000:]}"
        if program == "vapo-convert":
            last_ckpt = args[args.index("--out") + 1] if args[0] == "hf-to-mcore" else last_ckpt
            last_out = args[args.index("--out") + 1].rstrip("/")
            assert (clone / last_out).is_dir()
        found += 1
    assert found >= 4


def test_eval_commands_pass_their_checks(clone, monkeypatch):
    from vapo_megatron.eval import check_args, parse_args
    from vapo_megatron.evaluation.offline import resolve_model

    monkeypatch.chdir(clone)
    found = 0
    for words in readme_commands():
        nproc, program, args = launch(words)
        if program != "vapo-eval" or "..." in args:  # the sglang template line needs GPUs
            continue
        parsed = parse_args(args)
        check_args(parsed)
        assert resolve_model(parsed.model).checkpoint == Path(DEMO_ACTOR)  # iter_N -> its actor
        found += 1
    assert found == 1
