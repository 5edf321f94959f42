"""trainer.offload_during_rollout changes memory, never results: the shortened demo (2 ranks,
TP=2, embedded engine, deterministic) with the trainer's state in host memory during every
rollout and eval, killed mid-run (VAPO_FAULT=rollout@2 under tests/helpers/faults.py: SIGKILL
while the state is offloaded) and resumed, ends with bitwise the same actor and critic (weights, fp32 main
parameters, Adam moments and steps), run state and metrics as an uninterrupted run without the
offload; a NaN iteration (skipped optimizer steps) comes before the kill in both. Every run's
ranks are forked from the suite's preloaded forkserver (tests/helpers/train_runs.py
launch_in_forks): the kill is each rank's own SIGKILL all the same."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers import faults
from tests.helpers.train_runs import checkpoint_tensors, launch_in_forks, make_demo_data, records, train_in_forks
from vapo_megatron.trainer.timing import PHASES

CONFIG = "demo_cpu.yaml"
VAPO_STEPS = 3
FINAL = f"iter_{1 + VAPO_STEPS:07d}"  # one value-pretraining iteration (0), then VAPO iterations 1..3


def _settings(data: Path, run_dir: Path, offload: bool) -> list[str]:
    """A few seconds of the demo: no SFT, one value-pretraining iteration, 3 VAPO iterations of 8
    prompts x 2 samples, a checkpoint after every iteration, an eval after the second."""
    return [
        f"trainer.run_dir={run_dir}", f"model.hf_path={data}/model", f"data.train_files=[{data}/train.jsonl]",
        f"data.eval_files=[{data}/eval.jsonl]", "eval.every=2", "eval.n_samples=2", "eval.max_prompts=4",
        "sft.files=[]", "sft.steps=0", "algo.value_pretrain_steps=1",
        "rollout.prompts_per_step=8", "rollout.n_samples=2", "rollout.max_new_tokens=4",
        f"trainer.total_steps={VAPO_STEPS}", "trainer.save_every=1", "trainer.deterministic=true",
        "trainer.export_hf=false", "trainer.tensorboard=false",
        f"trainer.offload_during_rollout={str(offload).lower()}",
    ]


def _comparable(r: dict) -> str:  # timings differ; NaN != NaN, so compare the JSON text
    return json.dumps({k: v for k, v in r.items() if not k.startswith("perf/")}, sort_keys=True)


def test_offload_gives_bitwise_the_same_run_across_a_kill_and_resume(tmp_path):
    data = make_demo_data(tmp_path / "data", n_train=64, n_eval=8, n_sft=8)
    nan = {"VAPO_FAULT": "nan_loss@1"}  # iteration 1's optimizer steps are skipped in both runs
    want, have = tmp_path / "off", tmp_path / "on"
    train_in_forks(CONFIG, *_settings(data, want, False), env=nan, module=faults.ENTRY)

    killed = launch_in_forks(CONFIG, _settings(data, have, True), env={"VAPO_FAULT": "nan_loss@1,rollout@2"},
                             module=faults.ENTRY)
    assert (killed.returncode != 0
            and "[vapo] VAPO_FAULT: killing rank 0 at rollout@2\n" in killed.stdout), killed.output[-3000:]
    assert (have / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    run = train_in_forks(CONFIG, *_settings(data, have, True), env=nan, module=faults.ENTRY)
    assert (f"[vapo] resumed from {have / 'checkpoints' / 'iter_0000002'} at iteration 2\n"
            in run.stdout), run.output[-3000:]
    assert "[vapo] trainer state offloaded during rollout (rank 0): offload " in run.stdout, run.output[-3000:]

    for model in ("actor", "critic"):
        a = checkpoint_tensors(want / "checkpoints" / FINAL / model)
        b = checkpoint_tensors(have / "checkpoints" / FINAL / model)
        assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, f"{model}: differs from the run without offload: {differ}"
    state = [json.loads((d / "checkpoints" / FINAL / "state.json").read_text())["state"] for d in (want, have)]
    assert state[0] == state[1]
    a, b = records(want), records(have)
    assert [_comparable(r) for r in a] == [_comparable(r) for r in b]
    steps_a = [r for r in a if r["phase"] in ("value_pretrain", "vapo")]
    steps_b = [r for r in b if r["phase"] in ("value_pretrain", "vapo")]
    assert any(r["critic/skipped_steps"] > 0 for r in steps_a)  # the NaN iteration did skip
    assert all(r["perf/offload_s"] == 0.0 and r["perf/onload_s"] == 0.0 for r in steps_a)
    assert all(r["perf/offload_s"] > 0.0 and r["perf/onload_s"] > 0.0 for r in steps_b), steps_b
    phases = [f"perf/{p}_s" for p in (*PHASES, "other")]
    assert {"perf/offload_s", "perf/onload_s"} <= set(phases)
    for r in steps_b:  # the moves are phases of their own: nothing counted twice, nothing left out
        assert abs(sum(r[k] for k in phases) - r["perf/step_s"]) <= 1e-9 * r["perf/step_s"], r
