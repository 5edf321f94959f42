"""benchmarks/demo_report.py judges what the demo demonstrates, learning, and only reports the time:
run on metrics.jsonl files written here (the trainer's record layout), as `make demo` runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _write_run(run_dir: Path, before: float, after: float, steps: int = 4) -> None:
    records = [{"step": 0, "phase": "data", "data/train_prompts": 64},
               {"step": 0, "phase": "eval", "eval/accuracy": before, "eval/accuracy_before_vapo": before}]
    for step in range(1, steps + 1):
        records.append({"step": step, "phase": "vapo", "reward/mean": 0.1 * step, "perf/rollout_s": 3.0,
                        "perf/actor_update_s": 1.0, "perf/critic_update_s": 0.5, "perf/other_s": 0.5,
                        "perf/step_s": 5.0})
    records.append({"step": steps, "phase": "eval", "eval/accuracy": after, "eval/accuracy_final": after})
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _report(run_dir: Path, seconds: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.demo_report", str(run_dir), "--seconds", str(seconds)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_demo_that_learned_passes_however_slow_the_machine(tmp_path):
    _write_run(tmp_path / "run", before=0.430, after=0.892)  # the run on a loaded machine
    proc = _report(tmp_path / "run", seconds=1500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gain +0.462" in proc.stdout and "learned (targets met)" in proc.stdout
    assert "wall time 1500 s" in proc.stdout and "time is not a target" in proc.stdout
    # The phase split over the RL steps: 4 steps x 5 s, rollout 60%, actor 20%, critic 10%, other 10%.
    assert ("4 RL steps took 20 s (5.00 s each): rollout 60%, actor_update 20%, critic_update 10%, "
            "other 10%" in proc.stdout)


def test_a_demo_that_did_not_learn_fails_however_fast(tmp_path):
    _write_run(tmp_path / "run", before=0.430, after=0.500)
    proc = _report(tmp_path / "run", seconds=60)
    assert proc.returncode == 1
    assert "targets NOT met (accuracy gain +0.070 < 0.20)" in proc.stdout
