"""vapo-train with the critic at a layout of its own (critic.parallel: TP=1, so DP=2, beside the
actor's TP=2) on the same two ranks: SFT, the policy's trunk into the critic at its layout, value
pretraining, VAPO steps with several micro-batches per rank, checkpoints, and the state offloaded
to host memory during every rollout (both models, whatever their layouts).

- Stopped after one VAPO step and resumed at the same layouts, the run's records are bitwise those
  of an uninterrupted run: the critic's checkpoint holds what it had.
- Resumed from that checkpoint with the critic at the actor's layout instead (its checkpoint read
  at TP=2: dist checkpoints reshard), the next step's critic figures agree with the uninterrupted
  run's to float rounding (its sums run in another order), not to a fresh critic's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.train_runs import records, train_in_forks

OWN = ("parallel.tp=2", "critic.parallel.tp=1")


@pytest.fixture(scope="module")
def chain_data(tmp_path_factory) -> Path:
    from vapo_megatron.tasks.chain_task import write_chain_dir
    from vapo_megatron.tasks.demo_task import TinyModelSpec

    data = tmp_path_factory.mktemp("chain-critic-layout") / "data"
    write_chain_dir(str(data), seed=0, n_train=32, n_eval=4, n_sft=8,
                    spec=TinyModelSpec(hidden_size=32, num_layers=4, intermediate_size=64))
    return data


def _run(d: Path, run_dir: Path, steps: int, *layout: str):
    return train_in_forks(
        "chain_cpu.yaml", f"trainer.run_dir={run_dir}", f"model.hf_path={d / 'model'}",
        f"data.train_files=[{d}/train.jsonl]", f"data.eval_files=[{d}/eval.jsonl]", f"sft.files=[{d}/sft.jsonl]",
        "sft.steps=1", "sft.batch_size=4", "algo.value_pretrain_steps=1", f"trainer.total_steps={steps}",
        "rollout.prompts_per_step=8", "rollout.n_samples=2", "algo.mini_batches=2", "rollout.max_new_tokens=12",
        "data.max_prompt_tokens=48", "trainer.micro_batch_tokens=64", "eval.every=100", "eval.max_prompts=2",
        "eval.n_samples=1", "trainer.save_every=1", "trainer.tensorboard=false", "trainer.export_hf=false",
        "trainer.deterministic=true", "trainer.offload_during_rollout=true", *layout, timeout=300)


def _steps(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records(run_dir)
            if r.get("phase") in ("value_pretrain", "vapo")]


def test_the_critic_at_its_own_layout_trains_checkpoints_and_resumes(chain_data, tmp_path):
    whole, part, moved = tmp_path / "whole", tmp_path / "part", tmp_path / "moved"
    _run(chain_data, whole, 2, *OWN)
    want = _steps(whole)
    assert [r["phase"] for r in want] == ["value_pretrain", "vapo", "vapo"], want
    assert not (whole / "critic_trunk.tmp").exists()  # the trunk's way to the critic's layout is removed
    assert (whole / "checkpoints" / "iter_0000003" / "critic").is_dir()

    _run(chain_data, part, 1, *OWN)
    shutil.copytree(part, moved)
    run = _run(chain_data, part, 2, *OWN)
    assert "resumed from" in run.stdout
    assert _steps(part) == want  # bitwise: the same records, NaN-free JSON values compared exactly

    run = _run(chain_data, moved, 2, "parallel.tp=2", "critic.parallel.tp=2")  # the critic back at TP=2
    assert "resumed from" in run.stdout
    got = _steps(moved)[-1]
    for key in ("critic/value_loss", "critic/grad_norm", "actor/pg_loss", "actor/grad_norm"):
        assert got[key] == pytest.approx(want[-1][key], rel=1e-3, abs=1e-6), key
