"""The learning benchmark (python -m benchmarks.learning) end to end, as small as it gets (issues 31
and 45): one seed, two rows of the chain task with a tiny model, one RL step each, both at once
(--jobs 2, one process each): a critic with a trunk of its own (vapo_critic_4x: the seed's bigger
random-init model) and the positive control's oracle critic (vapo_oracle: scripts/bench_oracle.py,
no critic model at all). The harness trains, evaluates each export once on all held-out prompts
(the short/long figures from the same samples), runs the credit diagnostics on the critic's run,
and writes a summary per run and the table. A second call redoes nothing; a third with another
budget is refused before any work."""

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
    cmd = [sys.executable, "-m", "benchmarks.learning", "--variants", "vapo_critic_4x,vapo_oracle",
           "--seeds", "0", "--jobs", "2", "--nproc", "1", "--eval-k", "2", "--credit", "--out", str(tmp_path / "bench"),
           "--summaries", str(tmp_path / "summaries"), *TINY, *sets, *(extra or ("--steps", "1"))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, timeout=600)


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_two_rows_run_evaluate_tabulate_and_are_not_redone(tmp_path):
    done = bench(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = tmp_path / "bench" / "data" / "seed0"
    long = {r["prompt"] for r in rows(data / "eval_long.jsonl")}
    prompt_at = {i: r["prompt"] for i, r in enumerate(rows(data / "eval.jsonl"), start=1)}
    for variant in ("vapo_critic_4x", "vapo_oracle"):
        s = json.loads((tmp_path / "summaries" / f"{variant}_seed0.json").read_text())
        assert s["status"] == "finished" and s["samples"] == s["samples_generated"] == 1 * 2 * 2, s
        assert s["record"]["steps"] == 1 and s["heldout_prompts"] == 16 and s["eval_k"] == 2, s
        # long chains' avg@2, recomputed from vapo-eval's samples of all 16 prompts
        samples = rows(tmp_path / "bench" / variant / "seed0" / "eval" / "samples.jsonl")
        mine = [x["correct"] for x in samples if prompt_at[int(x["source"].rsplit(":", 1)[1])] in long]
        assert s["long_prompts"] == len(mine) // 2 > 0 and s["long_avg@K"] == sum(mine) / len(mine), s
        assert s["cpu_s"] > 0 and s["eval_cpu_s"] > 0 and s["curve"], s
        assert s["train_code"] and s["train_code"][0].startswith(s["code"][:7]), s  # the commit that trained it
    s = json.loads((tmp_path / "summaries" / "vapo_critic_4x_seed0.json").read_text())
    critic = json.loads((tmp_path / "bench" / "vapo_critic_4x" / "seed0" / "critic_hf" / "config.json").read_text())
    assert critic["hidden_size"] == 128 and s["credit"]["explained_variance_by_position"], s
    # Summaries are committed: they name the run relative to --out, no path of this machine.
    assert s["credit"]["run"] == "vapo_critic_4x/seed0", s["credit"]["run"]
    assert "credit" not in json.loads((tmp_path / "summaries" / "vapo_oracle_seed0.json").read_text())
    # The oracle ran as the critic role: its values were logged as a critic's, and no critic model exists.
    oracle = tmp_path / "bench" / "vapo_oracle" / "seed0"
    metrics = [r for r in rows(oracle / "metrics.jsonl") if r.get("phase") == "vapo"]
    assert (metrics and "critic/explained_variance" in metrics[0]
            and "critic/oracle_carried_fraction" in metrics[0]), metrics
    assert "critic/value_loss" not in metrics[0] and not list(oracle.glob("checkpoints/iter_*/critic")), metrics[0]
    table = (tmp_path / "bench" / "table.md").read_text()
    assert "| vapo_critic_4x | 0 | 4 |" in table and "| vapo_oracle | 0 | 4 |" in table, table
    assert (tmp_path / "bench" / "learning.png").stat().st_size > 0
    again = bench(tmp_path)
    assert again.returncode == 0 and "| vapo_oracle | 0 | 4 |" in again.stdout, again.stdout[-2000:]
    log = (tmp_path / "bench" / "vapo_oracle" / "seed0" / "bench.log").read_text()
    assert (log.count("bench_oracle.py --config") == 1
            and log.count("vapo_megatron.eval") == 1), "a finished run was redone"
    other = bench(tmp_path, "--steps", "2")
    assert other.returncode == 2 and other.stderr.count("\n") == 1 and "steps=1" in other.stderr, other.stderr
    assert (tmp_path / "bench" / "vapo_oracle" / "seed0" / "bench.log").read_text() == log
