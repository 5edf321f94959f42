"""vapo-train on the chain task at the layouts whose micro-batch counts must agree (issue 63), with a
token budget small enough that every rank runs several micro-batches of its own lengths: the
chain's prompts (2 to 10 terms) differ in length across the two ranks.

- Qwen3-MoE at EP=2 (the two DP ranks each hold two of the four experts; routing replay on): before
  the fix the ranks' counts differed and the first step's all-to-all deadlocked;
- a 4-layer dense model at PP=2 x VPP=2: the first schedule call raised "The remainder of M";
- the same dense model at DP=2: the control, where each rank keeps its own plan.
Each is one VAPO step after one value-pretraining step (critic and actor forwards and updates),
its ranks forked as torchrun would start them (tests/helpers/train_runs.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tiny_hf import save_demo_sized
from tests.helpers.train_runs import records, train_in_forks

LAYOUTS = {
    "moe-ep2": ("qwen3_moe", ["parallel.tp=1", "parallel.ep=2"]),
    "dense-pp2-vpp2": ("model", ["parallel.tp=1", "parallel.pp=2", "parallel.vpp=2"]),
    "dense-dp2": ("model", ["parallel.tp=1"]),
}


@pytest.fixture(scope="module")
def chain_data(tmp_path_factory) -> Path:
    from vapo_megatron.tasks.chain_task import write_chain_dir
    from vapo_megatron.tasks.demo_task import TinyModelSpec

    data = tmp_path_factory.mktemp("chain-layouts") / "data"
    write_chain_dir(str(data), seed=0, n_train=32, n_eval=4, n_sft=4,
                    spec=TinyModelSpec(hidden_size=32, num_layers=4, intermediate_size=64))
    save_demo_sized(data / "qwen3_moe", data / "tokenizer", family="qwen3_moe")
    return data


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_chain_step_at_each_layout_with_several_micro_batches_per_rank(chain_data, tmp_path, name):
    model, layout = LAYOUTS[name]
    d, run_dir = chain_data, tmp_path / "run"
    train_in_forks("chain_cpu.yaml", f"trainer.run_dir={run_dir}", f"model.hf_path={d / model}",
                   f"data.train_files=[{d}/train.jsonl]", f"data.eval_files=[{d}/eval.jsonl]",
                   f"sft.files=[{d}/sft.jsonl]",
                   "sft.steps=0", "algo.value_pretrain_steps=1", "trainer.total_steps=1", "rollout.prompts_per_step=8",
                   "rollout.n_samples=2", "algo.mini_batches=2", "rollout.max_new_tokens=12",
                   "data.max_prompt_tokens=48",
                   "trainer.micro_batch_tokens=64", "eval.every=100", "eval.max_prompts=2", "eval.n_samples=1",
                   "trainer.save_every=100", "trainer.tensorboard=false", "trainer.export_hf=false", *layout,
                   timeout=240)  # a hang (the defect) fails in minutes, not at gloo's 30-minute timeout
    steps = [r for r in records(run_dir) if r.get("phase") in ("value_pretrain", "vapo")]
    assert [r["phase"] for r in steps] == ["value_pretrain", "vapo"], steps
    assert all(r["perf/padding_ratio"] < 1 for r in steps) and "actor/pg_loss" in steps[-1]
