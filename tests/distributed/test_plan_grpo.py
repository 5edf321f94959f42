"""vapo-plan without a critic (algo.estimator=grpo): configs/qwen2.5_32b_dapo.yaml loads, and plans
on 8 nodes x 8 H100 80 GB with the actor alone (no critic shards, state, activations or checkpoint
bytes); against the same config with a critic, sized at the same rollout peak, its KV cache is
larger by the critic's state whenever that state would stay on the GPU during rollout, and equal
with trainer.offload_during_rollout (the critic's state would be in host memory then).
vapo-plan runs in a spawned process (fake process group, cpu_compat: not in the pytest process).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from tests.distributed.test_plan import QWEN25_32B, megatron_padded_vocab, naive_count
from tests.helpers.dist_utils import run_ranks

REPO = Path(__file__).resolve().parents[2]
DAPO = str(REPO / "configs" / "qwen2.5_32b_dapo.yaml")
GIB = float(1 << 30)


def test_dapo_config_loads_with_dapos_settings():
    from vapo_megatron.config import ConfigError, load_config

    cfg = load_config(DAPO, [], check_paths=False)
    a, r = cfg.algo, cfg.rollout
    assert a.estimator == "grpo" and a.value_pretrain_steps == 0 and a.nll_coef == 0.0 and a.loss_agg == "token"
    assert (a.eps_low, a.eps_high, a.mini_batches) == (0.2, 0.28, 16)
    assert (r.prompts_per_step, r.n_samples, r.max_new_tokens, r.temperature, r.top_p) == (512, 16, 20480, 1.0, 1.0)
    assert r.dynamic_sampling and r.max_sampling_rounds >= 1
    assert (cfg.reward.overlong_buffer, cfg.reward.overlong_penalty) == (4096, 1.0)
    assert (cfg.reward.correct_score, cfg.reward.incorrect_score) == (1.0, -1.0)
    assert cfg.actor_optim.lr == 1e-6 and cfg.actor_optim.warmup_steps == 20 * a.mini_batches  # 20 rollout steps
    # The VAPO config's data, layout and launch.
    vapo = load_config(str(REPO / "configs" / "qwen2.5_32b_vapo.yaml"), [], check_paths=False)
    assert (cfg.data, cfg.parallel, cfg.eval) == (vapo.data, vapo.parallel, vapo.eval)
    # No critic: a critic-only key set on top of it is refused, naming it.
    with pytest.raises(ConfigError,
                       match=r"algo.gamma \(GAE's discount\) is set, but algo.estimator=grpo has no critic"):
        load_config(DAPO, ["algo.gamma=0.99"], check_paths=False)


def _plans():
    from vapo_megatron.config import parse_config
    from vapo_megatron.plan import main
    from vapo_megatron.sizing.plan import make_plan
    from vapo_megatron.sizing.report import format_plan

    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = main(["--config", DAPO, "--nodes", "8", "--gpus-per-node", "8", "--preset", "qwen2.5-32b"])
    # The trainer's state resident during rollout, the engine's share at what it leaves: fits
    # without a critic; the same with a critic does not.
    cfg = parse_config(DAPO, ["trainer.offload_during_rollout=false", "rollout.sglang.mem_fraction=0.70"])[0]
    resident = make_plan(cfg, QWEN25_32B, QWEN25_32B, world_size=64, gpu_memory_gib=80.0)
    return rc, o.getvalue(), e.getvalue(), resident, format_plan(resident, cfg, model_source="test", nodes=8,
                                                                 gpus_per_node=8)


def test_grpo_plan_has_no_critic_and_more_kv_cache():
    rc, out, err, plan, text = run_ranks(1, _plans)[0]

    # The DAPO config plans on 8 x 8 H100 80 GB, the actor alone.
    assert rc == 0 and err == "", out + err
    assert "fits: training peak" in out and "DOES NOT FIT" not in out
    assert "x 1 model (actor);" in out and "distributed optimizer: actor on, critic none (algo.estimator=grpo)" in out
    assert ("critic: none (algo.estimator=grpo): no parameters, gradients, optimizer state or activations; "
            "not built" in out)
    assert not [x for x in out.splitlines() if x.lstrip().startswith("critic ")]  # no critic line of state
    assert "actor parameters, gradients and optimizer state" in out and "actor and critic" not in out
    # A checkpoint is the actor's: bf16 weights + fp32 master + Adam's two moments, 14 bytes a parameter.
    ckpt = naive_count(QWEN25_32B, vocab=megatron_padded_vocab(QWEN25_32B["vocab_size"], 8), critic=False) * 14
    assert f"checkpoints: {ckpt / 1e9:,.1f} GB per save (actor: bfloat16 weights" in out
    # As shipped (offload on): the KV cache of the VAPO config, the critic would be in host memory.
    assert "KV cache 60.4 GiB = 1,978,215 tokens per engine (87 full sequences" in out
    assert "trainer state offloaded:  60.4 GiB = 87 full sequences /  60.4 GiB = 87: +0.0 GiB, +0 sequences" in out
    assert "trainer state resident:   48.4 GiB = 70 full sequences /  36.4 GiB = 52: +12.0 GiB, +18 sequences" in out
    assert "12.0 GiB less trainer state per GPU" in out
    # The actor's state alone: 12 GiB per GPU freed, its weights and Adam (8 GiB) in pinned host memory.
    assert "frees 12.0 GiB per GPU (worst rank), of which 8.0 GiB in pinned host memory" in out
    assert "up to 64.0 GiB per node of 8 GPUs" in out

    # No critic anywhere in the plan: shards, parts, the rollout phase, the offload.
    assert plan.models == ("actor",) and plan.with_critic.models == ("actor", "critic")
    assert all(s.critic_params == s.critic_unique == s.critic_expert == 0 for s in plan.shards)
    assert all(s.critic_params > 0 for s in plan.with_critic.shards)
    for m in plan.ranks:
        assert not [k for k in (*m.parts, *m.kv_resume, *m.offloaded) if k.startswith("critic")], m.parts.keys()
        assert len([k for k in m.kv_resume if k.startswith("actor ")]) == 3  # resident: the actor's state
    # Resident state: fits at rollout.sglang.mem_fraction 0.70 without a critic; with one it would not, and
    # at the same rollout peak its KV cache is smaller by the critic's state on the worst rank.
    assert not plan.problems and any(p.startswith("rollout does not fit") for p in plan.with_critic.problems)
    other = plan.with_critic.kv_compare["resident"]
    critic_state = plan.with_critic.state_per_gpu - plan.state_per_gpu
    assert plan.kv_compare["resident"]["kv_cache"] == plan.kv_cache
    assert plan.kv_cache - other["kv_cache"] == critic_state and abs(critic_state - 12 * GIB) < 0.05 * GIB
    assert plan.kv_tokens > other["kv_tokens"] and plan.kv_compare["resident"]["sequences"] > other["sequences"]
    assert f"+{critic_state / GIB:.1f} GiB" in text and "<- this config" in text


def _tiny(config: str, model_dir: str):
    from vapo_megatron.plan import main

    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = main(["--config", config, "--nodes", "1", "--gpus-per-node", "2", "--gpu-memory-gib", "8",
                   "--reserve-gib", "1", f"model.hf_path={model_dir}"])
    return rc, o.getvalue(), e.getvalue()


def test_grpo_plan_without_a_colocated_engine(tmp_path):
    """The CPU demo under grpo (embedded engine, no KV cache to size): the actor alone, and the
    comparison says what the critic would have cost."""
    from model_providers.presets import preset
    from vapo_megatron.config.checks import CRITIC_ONLY

    (tmp_path / "config.json").write_text(json.dumps(preset("tiny-qwen2")))
    # The demo config as a grpo run: its critic-only keys removed (grpo refuses them).
    demo = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    demo.pop("critic_optim")
    demo["algo"] = {k: v for k, v in demo["algo"].items() if f"algo.{k}" not in CRITIC_ONLY} | {
        "estimator": "grpo", "value_pretrain_steps": 0}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(demo))
    rc, out, err = run_ranks(1, _tiny, str(tmp_path / "grpo.yaml"), str(tmp_path))[0]
    assert rc == 0, out + err
    assert "x 1 model (actor);" in out and "rollout.engine=embedded: no colocated engine" in out
    assert "no critic (algo.estimator=grpo) against the same config with one" in out
    assert "SGLang KV cache per GPU at this config's rollout peak" not in out
