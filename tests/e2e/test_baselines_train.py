"""The value-free baselines end to end (issue 30): configs/dapo.yaml (algo.estimator=grpo, dynamic
sampling, overlong shaping) at DP=2, so the kept groups are decided globally and dealt to both
ranks. Its checkpoints hold no critic, its metrics no critic/*, and a run SIGKILLed mid-step and
resumed ends bitwise where the uninterrupted run ends: weights, Adam state, the prompt sampler's
position and every step's metrics, sampling rounds included. Every run's 2 ranks are forked from
the suite's preloaded forkserver as torchrun would start them (tests/helpers/train_runs.py
launch_in_forks): the kill is each rank's own SIGKILL all the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import faults
from tests.helpers.train_runs import checkpoint_tensors, launch_in_forks, make_demo_data, records, train_in_forks

CONFIG = "dapo.yaml"
STEPS = 3
FINAL = f"iter_{STEPS:07d}"


def _settings(data: Path, run_dir: Path) -> list[str]:
    # A coin for a reward (tests/helpers/reward_fns.py): with 2 samples a group is single-valued
    # half the time, so steps take 1-3 rounds and some hit the cap and top up.
    return [
        f"trainer.run_dir={run_dir}", f"model.hf_path={data}/model", f"data.train_files=[{data}/train.jsonl]",
        "data.eval_files=[]", "sft.files=[]", "sft.steps=0", "parallel.tp=1",
        "rollout.prompts_per_step=4", "rollout.n_samples=2", "rollout.max_new_tokens=4", "algo.mini_batches=2",
        "reward.fn=tests.helpers.reward_fns:coin", f"trainer.total_steps={STEPS}", "trainer.save_every=1",
        "trainer.deterministic=true", "trainer.export_hf=false", "trainer.tensorboard=false",
    ]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    return make_demo_data(tmp_path_factory.mktemp("baselines") / "data", n_train=64, n_eval=8, n_sft=8)


@pytest.fixture(scope="module")
def reference(demo_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("dapo") / "run"
    train_in_forks(CONFIG, *_settings(demo_data, run_dir))
    return run_dir


def _steps(run_dir: Path, *, perf: bool = False) -> list[dict]:
    """Every RL step's metrics but (unless `perf`) the wall-clock ones."""
    return [{k: v for k, v in r.items() if perf or not k.startswith("perf/")} for r in records(run_dir)
            if r["phase"] == "vapo"]


def test_dapo_run_has_no_critic_and_samples_dynamically(reference):
    steps = _steps(reference, perf=True)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert not [k for r in steps for k in r if k.startswith("critic/") or k == "perf/critic_update_s"]
    assert "perf/actor_update_s" in steps[0]
    # No critic setting in the run's records (config.yaml here, state.json below).
    assert "critic_optim" not in (reference / "config.yaml").read_text()
    for r in steps:  # the 4 groups each step trains on, and what it took to find them
        assert r["rollout/groups_kept"] + r["rollout/groups_topped_up"] == 4, r
        assert r["rollout/prompts_consumed"] == 4 * r["rollout/sampling_rounds"] <= 4 * 10, r
        assert (r["rollout/groups_kept"] + r["rollout/groups_surplus"] + r["rollout/groups_dropped"]
                == r["rollout/prompts_consumed"]), r
        assert "reward/overlong_penalty_mean" in r
        # Every round's responses (and reward calls): the coin never fails.
        assert r["rollout/samples_generated"] == 2 * r["rollout/prompts_consumed"] and r["reward/errors"] == 0, r
    assert sum(r["rollout/groups_dropped"] for r in steps) > 0  # the coin made single-valued groups
    for ckpt in sorted((reference / "checkpoints").glob("iter_*")):
        assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["actor", "rng"], ckpt
    state = json.loads((reference / "checkpoints" / FINAL / "state.json").read_text())
    assert "critic_optim" not in state["config"] and state["config"]["algo"]["estimator"] == "grpo"
    sampler = state["state"]["sampler"]
    consumed = sum(r["rollout/prompts_consumed"] for r in steps)
    assert sampler["epoch"] * 64 + sampler["position"] == consumed  # the sampler advanced by every round


def test_killed_mid_step_resumes_to_the_same_run(reference, demo_data, tmp_path):
    run_dir = tmp_path / "run"
    killed = launch_in_forks(CONFIG, _settings(demo_data, run_dir), env={"VAPO_FAULT": "actor_update@1"},
                             module=faults.ENTRY)
    assert killed.returncode != 0 and "VAPO_FAULT: killing rank" in killed.stdout, killed.output[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000001"
    train_in_forks(CONFIG, *_settings(demo_data, run_dir))
    assert _steps(run_dir) == _steps(reference)
    want = checkpoint_tensors(reference / "checkpoints" / FINAL / "actor")
    have = checkpoint_tensors(run_dir / "checkpoints" / FINAL / "actor")
    assert want.keys() == have.keys() and any("optimizer" in k for k in want)
    for name in want:
        assert torch.equal(want[name], have[name]), f"actor {name} differs after the resume"
    state = lambda d: json.loads((d / "checkpoints" / FINAL / "state.json").read_text())["state"]  # noqa: E731
    assert state(run_dir) == state(reference)
