"""vapo-train with the critic at a layout of its own (critic.parallel) on the same two ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.train_runs import records, train_in_forks


@pytest.fixture(scope="module")
def chain_data(tmp_path_factory) -> Path:
    from vapo_megatron.tasks.chain_task import write_chain_dir
    from vapo_megatron.tasks.demo_task import TinyModelSpec

    data = tmp_path_factory.mktemp("chain-critic-layout") / "data"
    write_chain_dir(str(data), seed=0, n_train=32, n_eval=4, n_sft=8,
                    spec=TinyModelSpec(hidden_size=32, num_layers=4, intermediate_size=64))
    return data


def _args(d: Path, run_dir: Path, *more: str) -> list[str]:
    return [f"trainer.run_dir={run_dir}", f"model.hf_path={d / 'model'}",
            f"data.train_files=[{d}/train.jsonl]", f"data.eval_files=[{d}/eval.jsonl]", f"sft.files=[{d}/sft.jsonl]",
            "sft.steps=1", "sft.batch_size=4", "algo.value_pretrain_steps=1", "trainer.total_steps=1",
            "rollout.prompts_per_step=8", "rollout.n_samples=2", "algo.mini_batches=2", "rollout.max_new_tokens=12",
            "data.max_prompt_tokens=48", "trainer.micro_batch_tokens=64", "eval.every=100", "eval.max_prompts=2",
            "eval.n_samples=1", "trainer.save_every=1", "trainer.tensorboard=false", "trainer.export_hf=false", *more]


def test_a_run_with_the_critic_at_its_own_layout(chain_data, tmp_path):
    run_dir = tmp_path / "run"
    train_in_forks("chain_cpu.yaml", *_args(chain_data, run_dir, "parallel.tp=2", "critic.parallel.tp=1"),
                   timeout=300)
    steps = [r for r in records(run_dir) if r.get("phase") in ("value_pretrain", "vapo")]
    assert [r["phase"] for r in steps] == ["value_pretrain", "vapo"], steps
    print(steps[-1])
