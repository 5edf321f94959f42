"""slurm/*.sbatch on a real one-node Slurm cluster (scripts/slurm_local.sh), with the real trainer.

The training job runs `python -m vapo_megatron.train` on the demo config, shortened (tiny model,
TP=2 over two CPU workers under torchrun), submitted as documented: `sbatch ... CONFIG
trainer.run_dir=DIR`. One job runs to the end. A second one has its time limit cut mid-run: the
trainer sees that the next step and a save no longer fit (trainer.deadline: slurm), saves, is
requeued by the sbatch script and resumes, never reaching TIMEOUT, and must end at the same step
with bitwise the same actor and critic weights and optimizer state as the uninterrupted run. The
conversion job exports a critic checkpoint of that run to HF. SIGUSR1 (what `--signal=USR1@T`
does) and a resubmission after a failure are tested on two nodes (test_slurm_multinode.py); a
resubmission of a finished run changes nothing (test_records_once.py). Job state comes from
`scontrol show job` (no accounting daemon here).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from datetime import datetime
from pathlib import Path

import torch

from tests.helpers.slurm_cluster import wait_for
from tests.helpers.slurm_demo import (
    DEMO_CONFIG,
    FINAL_ITER,
    REPO,
    VAPO_STEPS,
    job_fields,
    sbatch,
    short_demo,
    submit_train,
    wait_done,
)
from tests.helpers.train_runs import checkpoint_tensors, hf_weights, records

CONVERT_SBATCH = REPO / "slurm" / "convert.sbatch"


def test_train_job_runs_the_trainer_to_the_end(uninterrupted, slurm_demo_data):
    run_dir, log, fields = uninterrupted
    text = log.read_text(errors="replace")
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "0"), text[-4000:]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"iter_{FINAL_ITER:07d}"
    final = ckpts / f"iter_{FINAL_ITER:07d}"
    assert {p.name for p in final.iterdir()} >= {"actor", "critic", "rng", "state.json"}
    state = json.loads((final / "state.json").read_text())
    assert state["complete"] and state["state"]["iteration"] == FINAL_ITER
    # the config the trainer ran with: the file plus the overrides; the run dir the command line's,
    # not the job's default (runs/<job name>-<job id> under the submit dir), which is never created
    assert state["config"]["trainer"]["run_dir"] == str(run_dir)
    assert not (REPO / "runs" / f"vapo-train-{fields['JobId']}").exists()
    assert state["config"]["trainer"]["total_steps"] == VAPO_STEPS
    assert state["config"]["data"]["train_files"] == [f"{slurm_demo_data}/train.jsonl"]
    phases = [r["phase"] for r in records(run_dir)]
    assert phases.count("value_pretrain") == 1 and phases.count("vapo") == VAPO_STEPS
    assert (run_dir / "hf" / "model.safetensors.index.json").is_file()
    assert "(1 nodes x 2 workers)" in text, text[-4000:]


def first_iteration_done(run_dir: Path) -> bool:  # the trainer's signal handlers are in place by then
    path = run_dir / "metrics.jsonl"
    return path.exists() and any(r["phase"] == "value_pretrain" for r in records(run_dir))


def assert_same_run(ref_dir: Path, run_dir: Path) -> None:
    """Same final step, same weights and optimizer state (bitwise) as the uninterrupted run."""
    assert (run_dir / "checkpoints" / "latest").read_text() == (ref_dir / "checkpoints" / "latest").read_text()
    final = f"iter_{FINAL_ITER:07d}"
    for model in ("actor", "critic"):
        want = checkpoint_tensors(ref_dir / "checkpoints" / final / model)
        have = checkpoint_tensors(run_dir / "checkpoints" / final / model)
        assert want.keys() == have.keys()
        differ = {k: float((want[k] - have[k]).abs().max()) for k in want if not torch.equal(want[k], have[k])}
        assert not differ, f"{model}: tensors differ after the requeue (max abs difference): {differ}"
    want, have = hf_weights(ref_dir / "hf"), hf_weights(run_dir / "hf")
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
    # Each iteration is logged once: the resumed run dropped the records after its checkpoint.
    steps = [r["step"] for r in records(run_dir) if r["phase"] in ("value_pretrain", "vapo")]
    assert steps == list(range(1, FINAL_ITER + 1))


def test_deadline_saves_and_requeues_before_the_time_limit(
        uninterrupted, slurm_env, slurm_demo_data, tmp_path):
    ref_dir = uninterrupted[0]
    run_dir, log = tmp_path / "run C", tmp_path / "job.out"
    # 30 minutes, the USR1 backstop 5 s before the end (the script's 75-minute lead exceeds the
    # limit); the trainer stops when the next step + a save + 300 s no longer fit.
    args = [str(DEMO_CONFIG), *short_demo(slurm_demo_data), "trainer.deadline_margin_s=300"]
    job_id = submit_train(run_dir, log, slurm_env, args, flags=("--time=30", "--signal=USR1@5"))
    wait_for(lambda: first_iteration_done(run_dir), 180, "the first training iteration", poll=0.05)
    # Cut the time limit to end 2-3 minutes from now (Slurm counts whole minutes from the start).
    start = datetime.fromisoformat(job_fields(job_id, slurm_env)["StartTime"]).timestamp()
    minutes = math.ceil((time.time() - start) / 60) + 2
    subprocess.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}"], check=True, env=slurm_env)
    wait_for(lambda: "[vapo] deadline:" in log.read_text(errors="replace"), 120, "the trainer's deadline stop")
    # The requeued job gets its 30 minutes back (it would stop again after one step otherwise).
    wait_for(lambda: subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=30"], env=slurm_env,
                                    capture_output=True).returncode == 0, 60, "the time limit to be restored")
    fields = wait_done(job_id, slurm_env, timeout=300)
    text = log.read_text(errors="replace")
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), text[-4000:]
    assert ("s left before the job's end" in text
            and "[vapo] stop (deadline): checkpoint at iteration" in text), text[-4000:]
    assert "asking for a requeue" in text and "DUE TO TIME LIMIT" not in text, text[-4000:]
    resumed = re.findall(r"resumed from .+ at iteration (\d+)", text)
    assert len(resumed) == 1 and 1 <= int(resumed[0]) < FINAL_ITER, text[-4000:]
    assert_same_run(ref_dir, run_dir)


def test_convert_job_exports_a_trainer_checkpoint(uninterrupted, slurm_env, tmp_path):
    ckpt = uninterrupted[0] / "checkpoints" / f"iter_{FINAL_ITER:07d}" / "critic"
    out, log = tmp_path / "critic hf", tmp_path / "convert.out"
    job_id = sbatch(CONVERT_SBATCH, ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out)], slurm_env, log, {})
    fields = wait_done(job_id, slurm_env, timeout=120)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log.read_text(errors="replace")[-4000:]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"] and config["num_labels"] == 1
    # The exported value head is the checkpoint's, and the trunk matches the dist checkpoint.
    exported, stored = hf_weights(out), checkpoint_tensors(ckpt)
    assert torch.equal(exported["score.weight"], stored["value_head.weight"])
    assert torch.equal(exported["score.bias"], stored["value_head.bias"])
    assert torch.equal(exported["model.norm.weight"], stored["decoder.final_layernorm.weight"])


def test_missing_config_fails_with_a_clear_message(slurm_env, tmp_path):
    log = tmp_path / "job.out"
    job_id = submit_train(tmp_path / "run", log, slurm_env, [str(tmp_path / "nope.yaml")])
    fields = wait_done(job_id, slurm_env, timeout=30)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0")
    assert f"config file '{tmp_path / 'nope.yaml'}' not found" in log.read_text()
