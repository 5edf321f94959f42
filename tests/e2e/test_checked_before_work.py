"""Every command checks at its start what would make it fail at its end (issue 44, part A).

An empty --out that is a mount point, an empty read-only --out, damaged tokenizer, chat template
and generation config files, a truncated dist-checkpoint shard, --engine sglang without CUDA: each
was found only after the work (a whole conversion or evaluation), or as a traceback. Here each is
one line naming it, exit 2, before any model is built. The commands run in this process where they
stop before building a model; the one conversion that must succeed runs as a real command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.quiet_check import users_env
from tests.helpers.tiny_hf import save_tiny, save_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]

# Both directions of vapo-convert, into empty directories that answer a rename as a mount point
# does (EBUSY): the conversion once ran in full, then failed to rename --out away.
MOUNTED_CONVERT = """
import errno, os, sys
hf, mc, back = sys.argv[1:4]
mounts = {mc, back}

def guarded(real):
    def move(src, dst, *a, **kw):
        if os.path.abspath(src) in mounts or os.path.abspath(dst) in mounts:
            raise OSError(errno.EBUSY, "Device or resource busy", str(src))
        return real(src, dst, *a, **kw)
    return move

os.rename, os.replace = guarded(os.rename), guarded(os.replace)
from vapo_megatron.convert import main
sys.exit(main(["hf-to-mcore", "--hf", hf, "--out", mc]) or main(["mcore-to-hf", "--ckpt", mc, "--out", back]))
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny HF model (its tokenizer within the embedding: transformers adds <|endoftext|> to the
    299 words), converted to Megatron and back into empty directories kept in place."""
    root = tmp_path_factory.mktemp("made")
    save_tiny(root / "hf", seed=3)
    save_tiny_tokenizer(root / "hf", vocab=299)
    (root / "eval.jsonl").write_text('{"prompt": "w1 w2", "answer": "w3"}\n')
    (root / "mc").mkdir()
    (root / "back").mkdir()
    inodes = {d: (root / d).stat().st_ino for d in ("mc", "back")}
    proc = subprocess.run([sys.executable, "-c", MOUNTED_CONVERT, root / "hf", root / "mc", root / "back"], text=True,
                          capture_output=True, env={**users_env(), "PYTHONPATH": str(ROOT)}, timeout=300)
    return root, inodes, proc


def test_convert_fills_an_empty_out_in_place_both_ways(made):
    from safetensors.torch import load_file

    from vapo_megatron.runtime.atomic import CONVERT_HF_TO_MCORE, CONVERT_MCORE_TO_HF, writer_of

    root, inodes, proc = made
    assert proc.returncode == 0, proc.stderr[-3000:]
    for d, writer in (("mc", CONVERT_HF_TO_MCORE), ("back", CONVERT_MCORE_TO_HF)):
        assert (root / d).stat().st_ino == inodes[d]  # never renamed
        assert writer_of(root / d) == writer and not (root / d / ".vapo-staging").exists()
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # nothing staged beside
    want = load_file(root / "hf" / "model.safetensors")
    got = {k: v for f in sorted((root / "back").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k]) for k in want)


# ---- before any work: a spy on the first step of the work, and the one-line answers ----------------

class Started(Exception):
    """The work began (a spy's report); the check should have refused before."""


def spy(monkeypatch, module, name: str) -> None:
    def started(*a, **kw):
        raise Started(f"{module.__name__}.{name} was called")
    monkeypatch.setattr(module, name, started)


def answered(capsys, main, argv: list, prog: str) -> tuple[int, str]:
    """(exit code, the command's one message: its first line and any "  - " lines after it)."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.replace("\r", "\n").splitlines()
    ours = [i for i, line in enumerate(lines) if line.startswith(prog)]
    assert len(ours) == 1 and "Traceback" not in err, err
    return code, "\n".join([lines[ours[0]], *(ln for ln in lines[ours[0] + 1:] if ln.startswith("  - "))])


def eval_argv(root: Path, model: Path, *extra) -> list:
    return ["--model", model, "--data", root / "eval.jsonl", "--n-samples", "2", "--max-new-tokens", "4",
            "--out", root / "eval-out", *extra]


@pytest.fixture()
def no_eval_work(monkeypatch):
    from vapo_megatron.evaluation import offline
    from vapo_megatron.mcore import parallel

    spy(monkeypatch, offline, "run")
    spy(monkeypatch, parallel, "init_distributed")


@pytest.fixture()
def no_convert_work(monkeypatch):
    from vapo_megatron.mcore import parallel

    spy(monkeypatch, parallel, "init_distributed")


def copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_truncated_shard_is_named_before_eval_or_export(made, tmp_path, capsys, no_eval_work, no_convert_work):
    """Half of a .distcp: vapo-eval and mcore-to-hf read only what they need and passed when the cut
    part was optimizer state, which a resume refuses (issue 44 item 8). Every storage file is now
    checked against the checkpoint's own metadata first (checkpoint/dist_io.py check_storage)."""
    from vapo_megatron import convert
    from vapo_megatron import eval as vapo_eval

    root = made[0]
    ckpt = copy(root / "mc", tmp_path / "mc")
    shard = max(ckpt.glob("*.distcp"), key=lambda p: (p.stat().st_size, p.name))
    full = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: full // 2])
    says = f"{shard} is truncated ({full // 2} bytes, the metadata needs {full})"
    code, message = answered(capsys, vapo_eval.main, eval_argv(root, ckpt), "vapo-eval")
    assert (code == 2 and message.startswith(f"vapo-eval: error: --model {ckpt}: unreadable checkpoint: ")
            and says in message)
    code, message = answered(capsys, convert.main, ["mcore-to-hf", "--ckpt", ckpt, "--out", tmp_path / "hf"],
                             "vapo-convert")
    assert code == 2 and says in message and not (tmp_path / "hf").exists()


def test_an_empty_read_only_out_is_refused_before_the_evaluation(made, tmp_path, capsys, monkeypatch, no_eval_work):
    """Only --out's parent was tried: the evaluation ran, then EROFS (issue 44 item 2). Root ignores
    mode bits, so the read-only file system's answer is simulated where files are created."""
    import errno
    import tempfile

    from vapo_megatron import eval as vapo_eval

    out = tmp_path / "ro"
    out.mkdir()
    real = tempfile.TemporaryFile

    def temporary_file(*a, dir=None, **kw):
        if dir is not None and os.path.abspath(dir) == str(out):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "TemporaryFile", temporary_file)
    argv = eval_argv(made[0], made[0] / "hf")
    argv[argv.index("--out") + 1] = out
    code, message = answered(capsys, vapo_eval.main, argv, "vapo-eval")
    assert code == 2 and message == f"vapo-eval: error: --out {out} cannot be written: nothing can be created in it " \
                                    "(read-only?); choose another --out"


DAMAGED = [  # a file that parses (or is text) but does not load, and what its one line says
    ("tokenizer.json", "{}", "does not load as a tokenizer (KeyError: 'added_tokens')"),
    ("chat_template.jinja", "{% if messages %}hello", "holds a chat template that is not valid Jinja (line 1: "),
    ("generation_config.json", '{"max_new_tokens": "lots"}', "is not a valid generation config (TypeError: "),
]


def train_argv(root: Path, run_dir: Path, hf: Path, *extra) -> list[str]:
    return ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), f"trainer.run_dir={run_dir}", f"model.hf_path={hf}",
            "parallel.tp=1", f"data.train_files=[{root / 'eval.jsonl'}]", "data.eval_files=[]", "sft.steps=0",
            "algo.value_pretrain_steps=0", "rollout.prompts_per_step=4", "rollout.n_samples=2", "algo.mini_batches=1",
            "trainer.total_steps=2", "trainer.tensorboard=false", "trainer.export_hf=false", *extra]


@pytest.fixture()
def no_trainer(monkeypatch):
    """vapo-train's start of the work (its signal handlers, then the Trainer) reported, not run."""
    from vapo_megatron.trainer import signals

    spy(monkeypatch, signals, "StopSignals")


@pytest.mark.parametrize("name,text,says", DAMAGED)
def test_a_file_that_parses_but_does_not_load_is_one_line_in_every_command(
        made, tmp_path, capsys, no_eval_work, no_trainer, name, text, says):
    """Before: a traceback from vapo-train (which left an empty run directory), "internal error"
    from vapo-eval, and vapo-convert copied the file into its output and exited 0 (issue 44 item 3)."""
    from vapo_megatron import convert, train
    from vapo_megatron import eval as vapo_eval

    root = made[0]
    hf = copy(root / "hf", tmp_path / "hf")
    (hf / name).write_text(text)
    code, message = answered(capsys, vapo_eval.main, eval_argv(root, hf), "vapo-eval")
    assert code == 2 and message.startswith(f"vapo-eval: error: --model {hf}: {hf / name} {says}"), message
    code, message = answered(capsys, convert.main, ["hf-to-mcore", "--hf", hf, "--out", tmp_path / "mc"],
                             "vapo-convert")
    assert code == 2 and message.startswith(f"vapo-convert: error: {hf / name} {says}"), message
    ckpt = copy(root / "mc", tmp_path / "ckpt")
    (ckpt / "hf" / name).write_text(text)
    code, message = answered(capsys, convert.main, ["mcore-to-hf", "--ckpt", ckpt, "--out", tmp_path / "back"],
                             "vapo-convert")
    assert code == 2 and message.startswith(f"vapo-convert: error: {ckpt / 'hf' / name} {says}"), message
    code, message = answered(capsys, train.main, train_argv(root, tmp_path / "run", hf), "vapo-train")
    assert code == 2 and message.startswith("vapo-train: configuration error: model.hf_path: "
                                            f"{hf / name} {says}"), message
    assert not [p for p in tmp_path.iterdir() if p.name not in ("hf", "ckpt")]  # no output, no run directory


def test_eval_refuses_sglang_without_cuda_as_the_trainer_does(made, capsys, no_eval_work, monkeypatch):
    """Before: "internal error: ModuleNotFoundError: No module named 'uvloop'" (issue 44 item 4).
    CUDA is hidden, so a machine with a GPU checks the same refusal."""
    import torch

    from vapo_megatron import eval as vapo_eval

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)  # SGLang's CPU engine: tests/e2e/test_sglang_eval.py

    code, message = answered(capsys, vapo_eval.main, eval_argv(made[0], made[0] / "hf", "--engine", "sglang"),
                             "vapo-eval")
    assert code == 2 and message == ("vapo-eval: error: --engine sglang needs CUDA GPUs and none is visible; "
                                     "allowed here: --engine embedded (or SGLang's CPU engine: "
                                     "SGLANG_USE_CPU_ENGINE=1, with sgl-kernel's CPU build)")


@pytest.mark.parametrize("flag,value,says", [
    ("--reward-timeout", "0", "--reward-timeout 0.0: must be a finite number of seconds > 0"),
    ("--reward-timeout", "nan", "--reward-timeout nan: must be a finite number of seconds > 0"),
    ("--temperature", "inf", "--temperature inf: must be a finite number > 0"),
    ("--correct-score", "nan", "--correct-score nan: must be a finite number"),
    ("--top-k", "0", "--top-k 0: must be -1 (off) or >= 1"),
    ("--sglang-mem-fraction", "1.5", "--sglang-mem-fraction 1.5: must be in (0, 1)"),
    ("--sglang-max-total-tokens", "0", "--sglang-max-total-tokens 0: must be >= 1"),
])
def test_every_number_of_vapo_eval_is_checked_naming_its_flag(made, capsys, no_eval_work, flag, value, says):
    """--reward-timeout 0 once said "timeout_s must be > 0", naming no flag (issue 44 items 5, 14)."""
    from vapo_megatron import eval as vapo_eval

    code, message = answered(capsys, vapo_eval.main, eval_argv(made[0], made[0] / "hf", flag, value), "vapo-eval")
    assert code == 2 and message.startswith(f"vapo-eval: error: {says}")


@pytest.mark.parametrize("options,says", [
    (["--gpu-memory-gib", "inf"], "--gpu-memory-gib=inf must be a finite number > 0"),
    (["--reserve-gib", "nan"], "--reserve-gib=nan must be a finite number >= 0"),
    (["--reserve-gib", "inf"], "--reserve-gib=inf must be a finite number >= 0"),
    (["--reserve-gib", "-5"], "--reserve-gib=-5 must be a finite number >= 0"),
    (["--gpu", "h100", "--storage-gb-per-s", "inf"], "--storage-gb-per-s=inf must be a finite number > 0"),
])
def test_every_number_of_vapo_plan_is_checked_naming_its_flag(capsys, options, says):
    """inf and nan were an OverflowError; a negative reserve lowered every peak (issue 44 items 5, 6)."""
    from vapo_megatron import plan

    argv = ["--config", ROOT / "configs" / "qwen2.5_32b_vapo.yaml", "--preset", "qwen2.5-32b", "--nodes", "8",
            "--gpus-per-node", "8", *options]
    code, message = answered(capsys, plan.main, argv, "vapo-plan")
    assert code == 2 and message.startswith("vapo-plan: invalid configuration for 8 x 8 GPUs: ") and says in message


def test_convert_and_train_refuse_numbers_out_of_range(made, tmp_path, capsys, no_convert_work):
    from vapo_megatron import convert
    from vapo_megatron.config import parse_config

    for mb in ("0", "-1"):
        code, message = answered(capsys, convert.main, ["mcore-to-hf", "--ckpt", made[0] / "mc", "--out",
                                                        tmp_path / "hf", "--max-shard-mb", mb], "vapo-convert")
        assert (code == 2
                and message == f"vapo-convert: error: --max-shard-mb={mb} must be >= 1 (MiB per safetensors shard)")
    _, problems = parse_config(str(ROOT / "configs" / "demo_cpu.yaml"), ["actor_optim.clip_grad=.inf",
                                                                         "rollout.wait_timeout_s=.inf"])
    assert problems == ["actor_optim.clip_grad must be a finite number, got inf",
                        "rollout.wait_timeout_s must be a finite number, got inf"]


def test_eval_names_its_own_schema_flag(made, tmp_path, capsys):
    """"set data.schema" is vapo-train's setting; vapo-eval's is --schema (issue 44 item 14)."""
    from vapo_megatron import eval as vapo_eval

    data = tmp_path / "other.jsonl"
    data.write_text('{"question": "w1", "solution": "w2"}\n')
    argv = eval_argv(made[0], made[0] / "hf")
    argv[argv.index("--data") + 1] = data
    code, message = answered(capsys, vapo_eval.main, argv, "vapo-eval")
    assert code == 2 and message.endswith("fix the field names or set --schema") and "data.schema" not in message


def finished_run(made, run_dir: Path, *, iteration: int = 2) -> Path:
    """run_dir as a run that finished at `iteration`: its checkpoint (the converted model as actor
    and critic, state.json marked complete and finished) and the `latest` pointer."""
    import json

    ckpt = run_dir / "checkpoints" / f"iter_{iteration:07d}"
    for sub in ("actor", "critic"):
        copy(made[0] / "mc", ckpt / sub)
    state = {"sampler": {"epoch": 0, "position": 0}, "iteration": iteration, "sft_steps_done": 0, "sft_finished": False,
             "pretrain_steps_done": 0, "pretrain_finished": False, "finished": True}
    (ckpt / "state.json").write_text(json.dumps({"state": state, "world_size": 1, "complete": True}))
    (run_dir / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    return ckpt


def test_a_rerun_of_a_finished_run_builds_nothing(made, tmp_path, capsys, no_trainer):
    """It built both models and loaded the checkpoint before it said "nothing to train" (issue 44
    item 12); now state.json answers first, with the same line and exit code. A run asked for more
    steps, or whose newest checkpoint is damaged (the resume falls back to an older one), goes on."""
    from vapo_megatron import train

    run_dir = tmp_path / "run"
    ckpt = finished_run(made, run_dir)
    assert train.main(train_argv(made[0], run_dir, made[0] / "hf")) == 0
    out = capsys.readouterr().out
    assert (f"[vapo] the run in {run_dir} has finished, at iteration 2 (trainer.total_steps=2 asks for 2): "
            "nothing to train" in out)
    with pytest.raises(Started):
        train.main(train_argv(made[0], run_dir, made[0] / "hf", "trainer.total_steps=3"))
    shard = next((ckpt / "critic").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(Started):
        train.main(train_argv(made[0], run_dir, made[0] / "hf"))
