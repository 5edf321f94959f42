"""The first screen of a run shows no library warning (vapo_megatron/config/quiet.py): a short real
vapo-train run on the tiny demo model, launched as `make demo` launches it (torchrun, two ranks,
TP=2), prints what matters once; so do its resume, vapo-convert mcore-to-hf and vapo-eval from its
checkpoint (which once printed torch's distributed-checkpoint warnings, issue 33 item 6);
VAPO_VERBOSE=1 brings the libraries' own lines back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_cpu.yaml"
# What the libraries printed before (megatron-core, torch, warnings.warn's own source line).
LIBRARY_NOISE = re.compile(r"Warning|warnings\.warn|DEPRECATED|deprecated|experimental|No CUDA runtime|"
                           r"Falling back|RNG state changed|Loading weights")
ACCELERATORS = "[vapo] Transformer Engine and Apex are not installed"


def _env(verbose: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "VAPO_VERBOSE",
                        "HF_HUB_DISABLE_PROGRESS_BARS", "PYTHONWARNINGS")}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"} | ({"VAPO_VERBOSE": "1"} if verbose else {})


def _lines(cmd: list, *, verbose: bool = False) -> list[str]:
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=_env(verbose), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    # A terminal shows tqdm's carriage-return updates on one line; count lines as it shows them.
    return [ln.split("\r")[-1] for ln in proc.stdout.splitlines()]


def _run(demo: Path, run_dir: Path, *, ranks: int, verbose: bool, steps: int = 1) -> list[str]:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", "29531", "-m", "vapo_megatron.train"] if ranks > 1
              else [sys.executable, "-m", "vapo_megatron.train"])
    cmd = launch + ["--config", str(CONFIG), f"trainer.run_dir={run_dir}", f"model.hf_path={demo}/model",
                    f"data.train_files=[{demo}/train.jsonl]", f"data.eval_files=[{demo}/eval.jsonl]",
                    "eval.n_samples=2", "eval.max_prompts=4", f"sft.files=[{demo}/sft.jsonl]", "sft.steps=1",
                    "sft.batch_size=4", "sft.eval_prompts=4", f"parallel.tp={ranks}", "algo.value_pretrain_steps=1",
                    "algo.mini_batches=1", "rollout.prompts_per_step=4", "rollout.n_samples=2",
                    "rollout.max_new_tokens=4", f"trainer.total_steps={steps}", "trainer.save_every=1",
                    "trainer.export_hf=false"]
    return _lines(cmd, verbose=verbose)


def _noise(lines: list[str]) -> str:
    return "\n".join(ln for ln in lines if LIBRARY_NOISE.search(ln))


def test_the_first_screen_of_a_demo_run_holds_no_library_warning(demo, tmp_path):
    lines = _run(demo, tmp_path / "quiet", ranks=2, verbose=False)
    screen = lines[:40]
    assert not _noise(screen), "library warnings on the first screen:\n" + _noise(screen)
    assert sum(ACCELERATORS in ln for ln in lines) == 1, "\n".join(screen)  # once, from rank 0
    assert any("[vapo] eval (final)" in ln for ln in lines)

    # Every command that reads the run's checkpoint is as quiet: the resume, mcore-to-hf, vapo-eval.
    lines = _run(demo, tmp_path / "quiet", ranks=2, verbose=False, steps=2)
    assert any("[vapo] resumed from" in ln for ln in lines) and not _noise(lines), _noise(lines) or lines
    ckpt = sorted((tmp_path / "quiet" / "checkpoints").glob("iter_*"))[-1]
    lines = _lines([sys.executable, "-m", "vapo_megatron.convert", "mcore-to-hf", "--ckpt", ckpt / "actor",
                    "--out", tmp_path / "hf"])
    assert any("wrote" in ln for ln in lines) and not _noise(lines), _noise(lines) or lines
    lines = _lines([sys.executable, "-m", "vapo_megatron.eval", "--model", ckpt, "--data", demo / "eval.jsonl",
                    "--n-samples", "2", "--max-prompts", "2", "--max-new-tokens", "4", "--out", tmp_path / "eval"])
    assert any("vapo-eval: wrote" in ln for ln in lines) and not _noise(lines), _noise(lines) or lines


def test_vapo_verbose_brings_the_library_lines_back(demo, tmp_path):
    text = "\n".join(_run(demo, tmp_path / "verbose", ranks=1, verbose=True))
    for expected in ("GPTModel IS DEPRECATED", "Transformer Engine and Apex are not installed. Falling back",
                     "MimoModelConfig is experimental", "full scope is deprecated"):
        assert expected in text, expected
