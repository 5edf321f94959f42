"""scripts/bench_learning.py end to end, as small as it gets (issue 31): one seed, two variants of
the chain task with a tiny model, one RL step each, both at once (--jobs 2, one process each);
the harness trains, evaluates the exported model on the short and long chains, writes a summary
per run and the table. A second call redoes nothing (the finished runs are recognised)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.train_runs import ROOT

TINY = ["--data-args", "--n-train 32 --n-eval 16 --n-sft 8 --hidden-size 32 --num-layers 1 --ffn-size 64"]
SETTINGS = ["parallel.tp=1", "sft.steps=0", "algo.value_pretrain_steps=0", "rollout.prompts_per_step=2",
            "rollout.n_samples=2", "rollout.max_new_tokens=12", "algo.mini_batches=1", "eval.max_prompts=2",
            "eval.n_samples=1", "eval.every=100", "trainer.save_every=100", "trainer.tensorboard=false"]


def bench(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    sets = [w for s in SETTINGS for w in ("--set", s)]
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_learning.py"), "--variants", "vapo,no_nll", "--seeds", "0",
           "--steps", "1", "--jobs", "2", "--nproc", "1", "--eval-k", "1", "--out", str(tmp_path / "bench"),
           "--summaries", str(tmp_path / "summaries"), *TINY, *sets, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, timeout=600)


def test_two_variants_run_tabulate_and_are_not_redone(tmp_path):
    done = bench(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for variant in ("vapo", "no_nll"):
        s = json.loads((tmp_path / "summaries" / f"{variant}_seed0.json").read_text())
        assert s["status"] == "finished" and s["samples"] == 1 * 2 * 2, s
        assert s["short_prompts"] > 0 and s["long_prompts"] > 0 and 0 <= s["long_avg@K"] <= 1, s
        assert s["wall_s"] > 0 and s["curve"], s
    assert "algo.nll_coef=0" in json.loads((tmp_path / "summaries" / "no_nll_seed0.json").read_text())["overrides"]
    table = (tmp_path / "bench" / "table.md").read_text()
    assert "| vapo | 0 | 4 |" in table and "| no_nll | 0 | 4 |" in table, table
    assert (tmp_path / "bench" / "learning.png").stat().st_size > 0
    again = bench(tmp_path)
    assert again.returncode == 0 and "| vapo | 0 | 4 |" in again.stdout, again.stdout[-2000:]
    log = (tmp_path / "bench" / "vapo" / "seed0" / "bench.log").read_text()
    assert log.count("vapo_megatron.train") == 1, "a finished run was trained again"
