"""VAPO_VERBOSE=1 brings back the libraries' own lines that vapo_megatron/config/quiet.py keeps off
a user's screen. That the commands are quiet without it is checked on the output of the suite's
real runs (tests/helpers/quiet_check.py): the demo run and its resume, vapo-convert and vapo-eval
from a trainer checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.quiet_check import users_env

ROOT = Path(__file__).resolve().parents[2]


def test_vapo_verbose_brings_the_library_lines_back(demo, tmp_path):
    """One rank, no torchrun: a short run of the demo config on the tiny demo model."""
    env = users_env("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")  # one process, no launcher
    cmd = [sys.executable, "-m", "vapo_megatron.train", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
           f"trainer.run_dir={tmp_path / 'verbose'}", f"model.hf_path={demo}/model",
           f"data.train_files=[{demo}/train.jsonl]", f"data.eval_files=[{demo}/eval.jsonl]", "eval.n_samples=2",
           "eval.max_prompts=4", f"sft.files=[{demo}/sft.jsonl]", "sft.steps=1", "sft.batch_size=4",
           "sft.eval_prompts=4", "parallel.tp=1", "algo.value_pretrain_steps=1", "algo.mini_batches=1",
           "rollout.prompts_per_step=4", "rollout.n_samples=2", "rollout.max_new_tokens=4", "trainer.total_steps=1",
           "trainer.save_every=1", "trainer.export_hf=false"]
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "VAPO_VERBOSE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for expected in ("GPTModel IS DEPRECATED", "Transformer Engine and Apex are not installed. Falling back",
                     "MimoModelConfig is experimental", "full scope is deprecated"):
        assert expected in proc.stdout, expected
