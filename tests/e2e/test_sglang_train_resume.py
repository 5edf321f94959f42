"""A VAPO run with sglang 0.5.23's own CPU engine colocated in the trainer (rollout.engine=sglang,
SGLangEngine.colocated's production start), killed with SIGKILL and resumed to the same run.

configs/demo_cpu.yaml cut to a few steps, in one process (parallel.tp=1: one engine per run, the
fewest engine starts a kill and a resume can have). The run trains every iteration, logs it, runs
its final eval and writes its HF export, and is then killed while it writes its final checkpoint
(VAPO_FAULT=checkpoint@3): what it logged is the record of a run never interrupted, and its
engine's processes die with it. The same command resumes from the newest complete checkpoint
(iter_2) in a new process, which starts its own engine, streams the checkpoint's weights into it,
and redoes iterations 2 and 3, the final eval and the export: the metrics (each step once, timings
aside) and the exported weights are bitwise the uninterrupted run's, and every step's engine
log-probs equal the trainer's (rollout/logprob_diff: SGLang's Qwen2 after every sync).

Sampling is greedy (rollout.top_k=1): SGLang honours the per-sample seeds only with deterministic
inference, which sglang 0.5.23 refuses on the CPU (tests/unit/test_sglang_api.py), so sampled
answers would come from its scheduler's RNG, which a new engine starts afresh. Greedy answers
depend on the weights alone: a resumed engine left with its random start-up weights (no first
sync) or a resume that redrew the prompts fails here (both tried). The seed stream of sampled
rollouts is the embedded engine's tests' (tests/e2e/test_fault_injection.py).
Both runs' ranks are forked (tests/helpers/train_runs.py train_in_forks) from the suite's preloaded
forkserver: the kill is the rank's own SIGKILL all the same. TEST DOUBLE: only sgl_kernel's CPU
build (tests/doubles/sglang/sgl_kernel via tests/helpers/sglang_world.py).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.helpers.train_runs import hf_weights, make_demo_data, records, train_in_forks

ITERATIONS = 4  # one value-pretraining iteration (0), then VAPO iterations 1..3
RESUMED_AT = "iter_0000002"  # save_every=2: the newest complete checkpoint when the final one is cut
ENTRY = "tests.helpers.sglang_world"  # vapo-train's main in SGLang's CPU world


def _settings(data, run_dir) -> list[str]:
    return [
        f"trainer.run_dir={run_dir}", f"model.hf_path={data}/model", f"data.train_files=[{data}/train.jsonl]",
        f"data.eval_files=[{data}/eval.jsonl]", "eval.max_prompts=4", "eval.n_samples=2", "eval.every=100",
        "sft.files=[]", "sft.steps=0", "algo.value_pretrain_steps=1", "algo.mini_batches=2",
        "rollout.prompts_per_step=8", "rollout.n_samples=2", "rollout.max_new_tokens=4", "rollout.top_k=1",
        "parallel.tp=1", "rollout.engine=sglang", "rollout.sglang_tp=1",
        # SGLang's CPU engine sizes its KV cache as a share of the host's memory (tests/e2e/test_sglang_eval.py)
        "rollout.sglang_mem_fraction=0.5", "rollout.sglang_max_total_tokens=4096",
        f"trainer.total_steps={ITERATIONS - 1}", "trainer.save_every=2", "trainer.tensorboard=false",
    ]


def _comparable(r: dict) -> str:  # timings differ; NaN != NaN, so compare the JSON text
    return json.dumps({k: v for k, v in r.items() if not k.startswith("perf/")}, sort_keys=True)


def _processes_with(marker: str) -> list[str]:
    """Live processes started with `marker` in their environment (/proc/PID/environ is the one a
    process was exec'd with: the engine's spawned scheduler and detokenizer have the rank's)."""
    out = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes() and (environ.parent / "stat").read_text().rsplit(") ", 1)[1][0] != "Z":
                out.append((environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return out


def test_a_run_with_sglang_killed_and_resumed_is_the_uninterrupted_run(tmp_path):
    data = make_demo_data(tmp_path / "data", n_train=64, n_eval=8, n_sft=8)
    run_dir = tmp_path / "run"
    marker = f"VAPO_TEST_RUN={uuid.uuid4().hex}"
    env = {"VAPO_FAULT": f"checkpoint@{ITERATIONS - 1}", marker.split("=")[0]: marker.split("=")[1]}
    with pytest.raises(AssertionError, match="rank 0 ended with exit code -9 and no result"):
        train_in_forks("demo_cpu.yaml", *_settings(data, run_dir), env=env, nproc=1, module=ENTRY)
    deadline = time.monotonic() + 30  # SGLang's processes die of their parent's death (PR_SET_PDEATHSIG)
    while (left := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"the killed run's SGLang processes outlived it: {left}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == RESUMED_AT
    uninterrupted = records(run_dir)
    shutil.copytree(run_dir / "hf", tmp_path / "hf_uninterrupted")

    resumed = train_in_forks("demo_cpu.yaml", *_settings(data, run_dir), nproc=1, module=ENTRY)
    assert f"[vapo] resumed from {run_dir / 'checkpoints' / RESUMED_AT} at iteration 2\n" in resumed.stdout

    steps = [r for r in uninterrupted if r["phase"] in ("value_pretrain", "vapo")]
    assert [r["step"] for r in steps] == list(range(1, ITERATIONS + 1))
    assert any(r["phase"] == "eval" and r["step"] == ITERATIONS for r in uninterrupted), "no final eval was logged"
    assert all(r["rollout/logprob_diff"] < 1e-6 for r in steps), [r["rollout/logprob_diff"] for r in steps]
    assert [_comparable(r) for r in records(run_dir)] == [_comparable(r) for r in uninterrupted]
    want, have = hf_weights(tmp_path / "hf_uninterrupted"), hf_weights(run_dir / "hf")
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
