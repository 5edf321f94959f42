"""The first screen of a run shows no library warning (vapo_megatron/config/quiet.py): a short real
vapo-train run on the tiny demo model, launched as `make demo` launches it (torchrun, two ranks,
TP=2), prints what matters once; VAPO_VERBOSE=1 brings the libraries' own lines back."""

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


def _run(demo: Path, run_dir: Path, *, ranks: int, verbose: bool) -> list[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "VAPO_VERBOSE",
                        "HF_HUB_DISABLE_PROGRESS_BARS", "PYTHONWARNINGS")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
               | ({"VAPO_VERBOSE": "1"} if verbose else {}))
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", "29531", "-m", "vapo_megatron.train"] if ranks > 1
              else [sys.executable, "-m", "vapo_megatron.train"])
    cmd = launch + ["--config", str(CONFIG), f"trainer.run_dir={run_dir}", f"model.hf_path={demo}/model",
                    f"data.train_files=[{demo}/train.jsonl]", f"data.eval_files=[{demo}/eval.jsonl]",
                    "eval.n_samples=2", "eval.max_prompts=4", f"sft.files=[{demo}/sft.jsonl]", "sft.steps=1",
                    "sft.batch_size=4", "sft.eval_prompts=4", f"parallel.tp={ranks}", "algo.value_pretrain_steps=1",
                    "algo.mini_batches=1", "rollout.prompts_per_step=4", "rollout.n_samples=2",
                    "rollout.max_new_tokens=4", "trainer.total_steps=1", "trainer.save_every=1",
                    "trainer.export_hf=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    # A terminal shows tqdm's carriage-return updates on one line; count lines as it shows them.
    return [ln.split("\r")[-1] for ln in proc.stdout.splitlines()]


def test_the_first_screen_of_a_demo_run_holds_no_library_warning(demo, tmp_path):
    lines = _run(demo, tmp_path / "quiet", ranks=2, verbose=False)
    screen = lines[:40]
    noise = [ln for ln in screen if LIBRARY_NOISE.search(ln)]
    assert not noise, "library warnings on the first screen:\n" + "\n".join(noise)
    assert sum(ACCELERATORS in ln for ln in lines) == 1, "\n".join(screen)  # once, from rank 0
    assert any("[vapo] eval (final)" in ln for ln in lines)


def test_vapo_verbose_brings_the_library_lines_back(demo, tmp_path):
    text = "\n".join(_run(demo, tmp_path / "verbose", ranks=1, verbose=True))
    for expected in ("GPTModel IS DEPRECATED", "Transformer Engine and Apex are not installed. Falling back",
                     "MimoModelConfig is experimental", "full scope is deprecated"):
        assert expected in text, expected
