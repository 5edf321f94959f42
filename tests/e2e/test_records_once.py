"""Every step is recorded once, in metrics.jsonl and in TensorBoard, across a crash and resume and
across reruns of a finished run (trainer/metrics.py, RunState.finished; issue 25, item 7).

vapo-train's main on one rank (TP=1) forked from the suite's preloaded forkserver
(tests/helpers/train_runs.py launch_in_forks: the command line's main, its return value as the
exit code, without an interpreter's start-up for each of the six runs) on the tiny demo model;
the crash is the test-only fault injection (VAPO_FAULT, tests/helpers/faults.py), a SIGKILL of
the rank in the middle of a step."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tests.helpers.train_runs import Launch, launch_in_forks


def _cli(demo: Path, run_dir: Path, *extra: str, fault: str = "") -> Launch:
    # A fault needs the tests' entry point (vapo-train with the fault hook installed).
    module = "tests.helpers.faults" if fault else "vapo_megatron.train"
    args = [f"trainer.run_dir={run_dir}", f"model.hf_path={demo}/model", f"data.train_files=[{demo}/train.jsonl]",
            f"data.eval_files=[{demo}/eval.jsonl]", "eval.n_samples=2", "eval.every=0",
            f"sft.files=[{demo}/sft.jsonl]", "sft.steps=3", "sft.batch_size=4", "sft.eval_every=100",
            "parallel.tp=1", "algo.value_pretrain_steps=0", "algo.mini_batches=1", "rollout.prompts_per_step=4",
            "rollout.n_samples=2", "rollout.max_new_tokens=4", "trainer.total_steps=4", "trainer.save_every=2",
            "trainer.tensorboard=true", "trainer.export_hf=false", *extra]
    return launch_in_forks("demo_cpu.yaml", args, env={"VAPO_FAULT": fault} if fault else {}, nproc=1, module=module)


def _scalars(tb_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0}).Reload()
    return [e.step for e in events.Scalars(tag)]


def test_a_crash_a_resume_and_reruns_record_every_step_once(demo, tmp_path):
    run_dir = tmp_path / "run"
    # Killed during step 4 (iteration 3), after step 3 was logged; the checkpoint is at step 2.
    crashed = _cli(demo, run_dir, fault="rollout@3")
    assert crashed.returncode != 0 and "VAPO_FAULT: killing" in crashed.stdout, crashed.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["phase"] == "vapo"] == [1, 2, 3]

    resumed = _cli(demo, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    text = (run_dir / "metrics.jsonl").read_bytes()
    records = [json.loads(line) for line in text.decode().splitlines()]
    assert [r["step"] for r in records if r["phase"] == "vapo"] == [1, 2, 3, 4]
    assert [r["sft_step"] for r in records if r["phase"] == "sft"] == [1, 2, 3]
    # eval.every=0: no periodic eval, the one before RL and the final one only (issue 55 item 13)
    assert Counter(r["phase"] for r in records if r["phase"] in ("data", "eval")) == {"data": 1, "eval": 2}

    # TensorBoard shows each step once: the resumed writer purged the crashed attempt's step 3.
    assert _scalars(run_dir / "tensorboard", "reward/mean") == [1, 2, 3, 4]
    assert _scalars(run_dir / "tensorboard", "eval/accuracy") == [0, 4]
    assert _scalars(run_dir / "tensorboard" / "sft", "sft/nll_loss") == [1, 2, 3]

    # Rerunning the finished run changes nothing: no second final eval, no new event.
    # A smaller trainer.total_steps (issue 33) says where the run finished and leaves its record.
    record = (run_dir / "config.yaml").read_bytes()
    for extra, asked in (((), 4), ((), 4), (("trainer.total_steps=2",), 2)):
        again = _cli(demo, run_dir, *extra)
        assert again.returncode == 0, again.stderr[-3000:]
        assert (f"has finished, at iteration 4 (trainer.total_steps={asked} asks for {asked}): nothing to train"
                in again.stdout), again.stdout[-2000:]
    assert (run_dir / "config.yaml").read_bytes() == record
    assert (run_dir / "metrics.jsonl").read_bytes() == text
    assert _scalars(run_dir / "tensorboard", "eval/accuracy") == [0, 4]
    assert _scalars(run_dir / "tensorboard", "reward/mean") == [1, 2, 3, 4]
