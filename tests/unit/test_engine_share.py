"""Issue 32, item 7: rollout.sglang.mem_fraction against trainer.offload_during_rollout at vapo-train's
start-up, not only in vapo-plan (sizing/plan.py resident_rollout_problem; the Trainer calls it through
sizing/plan.py check_engine_share once the models' state is measured, before any step, and
vapo-train answers its ConfigError with one line and exit 2). The 32B configs share 0.85 of the GPU
assuming the offload: without it the first KV-cache resume runs out of memory."""

from __future__ import annotations

from pathlib import Path

from vapo_megatron.config import load_config
from vapo_megatron.sizing.plan import resident_rollout_problem

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
H100 = int(79.1 * GIB)
STATE_32B = 24 * GIB  # the trainer's state per GPU of the 32B configs at TP=8, PP=4 (their comments; vapo-plan)


def _cfg(name: str, *overrides: str):
    return load_config(str(ROOT / "configs" / name), list(overrides), check_paths=False)


def test_32b_configs_without_offload_are_refused_naming_both_keys():
    for name in ("qwen3_32b_vapo.yaml", "qwen2.5_32b_vapo.yaml"):
        cfg = _cfg(name, "trainer.offload_during_rollout=false")
        msg = resident_rollout_problem(cfg, state_bytes=STATE_32B, gpu_bytes=H100, world_size=64)
        assert msg is not None and "\n" not in msg
        assert msg.startswith("rollout.sglang.mem_fraction=0.85 with trainer.offload_during_rollout=false does not fit")
        assert "set trainer.offload_during_rollout=true or lower rollout.sglang.mem_fraction to at most 0.63" in msg
        assert "24.0 GiB (the worst rank's, resident)" in msg


def test_what_fits_passes():
    cfg = _cfg("qwen3_32b_vapo.yaml")  # as shipped: with the offload
    assert resident_rollout_problem(cfg, state_bytes=STATE_32B, gpu_bytes=H100, world_size=64) is None
    # The config's own advice without the offload: 0.55.
    cfg = _cfg("qwen3_32b_vapo.yaml", "trainer.offload_during_rollout=false", "rollout.sglang.mem_fraction=0.55")
    assert resident_rollout_problem(cfg, state_bytes=STATE_32B, gpu_bytes=H100, world_size=64) is None
    # No colocated engine: nothing shares the GPU during rollout.
    cfg = _cfg("qwen3_32b_vapo.yaml", "trainer.offload_during_rollout=false", "rollout.engine=sglang_http",
               "rollout.sglang_http.urls=[http://h:1]")
    assert resident_rollout_problem(cfg, state_bytes=STATE_32B, gpu_bytes=H100, world_size=64) is None


def test_vapo_train_answers_it_as_a_configuration_error():
    """The ConfigError is raised inside Trainer(...), whose ConfigError vapo-train prints as one
    `configuration error` line with exit 2 (train.py main)."""
    from vapo_megatron.sizing import plan
    from vapo_megatron.trainer import trainer

    src = Path(trainer.__file__).read_text()
    assert "self.planner.check_engine_share(cfg, list(self.models.values()))" in src
    assert ("Planner(check_engine_share, predict_on_this_gpu)"
            in (Path(trainer.__file__).parents[1] / "train.py").read_text())
    assert "raise ConfigError(problem)" in Path(plan.__file__).read_text().split("def check_engine_share")[1]
