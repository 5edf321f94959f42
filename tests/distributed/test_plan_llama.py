"""vapo-plan sizes the Llama 3.1 presets: llama3.1-8b fits on one 8 x H100 80 GB node at TP=8, and
both presets' meta-device shards hold Meta's published parameter counts plus Megatron's
vocabulary padding (the reference: the model cards' 8,030,261,248 and 70,553,706,496 parameters,
independent of model_providers). vapo-plan runs in a spawned process (it activates cpu_compat
and a fake process group, which must not leak into pytest)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.dist_utils import run_ranks
from tests.helpers.plan_runs import plan_outputs

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "qwen2.5_32b_vapo.yaml")  # its training settings; the model is the preset's
PUBLISHED = {"llama3.1-8b": (8_030_261_248, 4096), "llama3.1-70b": (70_553_706_496, 8192)}


def test_vapo_plan_sizes_the_llama3_1_presets():
    ((rc8, out8, err8), (rc70, out70, err70)), = run_ranks(1, plan_outputs, [
        # One node: TP=8 (divides the 8 KV heads), no pipeline; the engine's share lowered to 0.5.
        ["--config", CONFIG, "--preset", "llama3.1-8b", "--nodes", "1", "--gpus-per-node", "8",
         "parallel.tp=8", "parallel.pp=1", "rollout.sglang.mem_fraction=0.5"],
        ["--config", CONFIG, "--preset", "llama3.1-70b", "--nodes", "8", "--gpus-per-node", "8"],
    ])
    assert rc8 == 0, out8 + err8
    assert "model: preset llama3.1-8b" in out8 and "TP=8 PP=1 VPP=- DP=1" in out8
    assert "fits: training peak" in out8 and "DOES NOT FIT" not in out8
    assert rc70 in (0, 1), out70 + err70  # sized either way; whether 70B fits 8 x 8 is not the point here
    for name, out in (("llama3.1-8b", out8), ("llama3.1-70b", out70)):
        published, hidden = PUBLISHED[name]
        # vocab 128256 padded by Megatron to a multiple of 128 x TP=8 = 1024: 129024 rows in the
        # embedding and in the untied output layer.
        padding = (129_024 - 128_256) * hidden
        actor = published + 2 * padding
        critic = published - 128_256 * hidden + padding + hidden + 1  # no output layer; a value head
        assert f"actor {actor:,}, critic {critic:,}" in out, (name, out[:1500])
