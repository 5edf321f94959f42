"""Loading a configuration: sections, overrides and every problem in one pass (config/load.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vapo_megatron.config import ConfigError, OptimConfig, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo_cpu.yaml")


def _write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_a_section_given_in_part_keeps_its_own_defaults(tmp_path):
    """critic_optim's default lr (2e-6, twice the actor's) is the section's, not OptimConfig's."""
    cfg, problems = parse_config(_write(tmp_path, "critic_optim:\n  clip_grad: 0.5\nactor_optim:\n  clip_grad: 0.5\n"))
    assert problems == []
    assert cfg.critic_optim.lr == 2e-6 and cfg.critic_optim.clip_grad == 0.5
    assert cfg.actor_optim.lr == 1e-6 == OptimConfig().lr


@pytest.mark.parametrize("bare", ["algo.value_clip", "algo", "=3"])
def test_an_override_must_be_key_equals_value(bare):
    cfg, problems = parse_config(DEMO, [bare])
    assert problems == [f"command-line override {bare!r} must be key=value (e.g. trainer.total_steps=10)"]
    assert cfg.algo.value_clip == 0.5 and cfg.algo.alpha == parse_config(DEMO)[0].algo.alpha  # nothing changed


def test_structural_and_value_problems_are_reported_together():
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["algo.alpah=0.1", "algo.gamma=1.5", "trainer.save_every=0", "parallel.vpp=2",
                           "rollout.sglang.max_total_tokens=0"], check_paths=False)
    msg = str(e.value)
    assert msg.startswith("5 invalid settings:"), msg
    for text in ("unknown config key algo.alpah", "algo.gamma=1.5 must be in [0, 1]",
                 "trainer.save_every=0 must be >= 1", "parallel.vpp=2 must be null, or >= 1 with parallel.pp >= 2",
                 "rollout.sglang.max_total_tokens=0 must be >= 1 (or null)"):
        assert text in msg, (text, msg)


def test_lr_schedule_settings_are_checked():
    with pytest.raises(ConfigError,
                       match=r"actor_optim.lr_decay_steps=5 must be greater than actor_optim.warmup_steps=5"):
        load_config(DEMO, ["actor_optim.warmup_steps=5", "actor_optim.lr_decay_steps=5"], check_paths=False)
    with pytest.raises(ConfigError, match=r"critic_optim.lr_decay_style='step' is not allowed \(choose one of: "
                                          r"constant, linear, cosine\)"):
        load_config(DEMO, ["critic_optim.lr_decay_style=step"], check_paths=False)


def test_a_resume_may_not_move_a_schedule_that_decays_over_the_run(tmp_path):
    """trainer.total_steps may change on a resume, unless a learning rate decays over the run's
    length (lr_decay_steps null): then the new length would change the updates already planned."""
    from vapo_megatron.config import resume

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "iter_0000001").mkdir(parents=True)
    base = [f"trainer.run_dir={run_dir}", "actor_optim.lr_decay_style=linear"]
    resume.save(parse_config(DEMO, base)[0])
    with pytest.raises(ConfigError) as e:
        resume.check_resume(parse_config(DEMO, [*base, "trainer.total_steps=300"])[0], announce=False)
    assert "  - trainer.total_steps: 200 in the run, 300 now" in str(e.value)
    assert ("actor_optim.lr_decay_style=linear with actor_optim.lr_decay_steps=null decays the "
            "learning rate" in str(e.value))
    fixed = [f"trainer.run_dir={run_dir}", "actor_optim.lr_decay_style=linear", "actor_optim.lr_decay_steps=500"]
    resume.save(parse_config(DEMO, fixed)[0])
    resume.check_resume(parse_config(DEMO, [*fixed, "trainer.total_steps=300"])[0], announce=False)  # passes


def test_grpo_refuses_every_critic_only_setting_by_name():
    """algo.estimator=grpo has no critic: each critic-only key changed from its default is one line."""
    from vapo_megatron.config.checks import CRITIC_ONLY

    grpo = str(ROOT / "configs" / "grpo.yaml")
    assert load_config(grpo, check_paths=False).algo.estimator == "grpo"  # the shipped config passes
    changed = {"algo.lambda_critic": "0.9", "algo.value_clip": "null", "algo.value_pretrain_ev_threshold": "0.5",
               "algo.decoupled_gae": "false", "algo.length_adaptive": "false", "algo.lambda_policy": "0.9",
               "algo.alpha": "1.0", "algo.gamma": "0.99", "critic_optim": None, "model.critic_hf_path": str(ROOT),
               "critic": None}
    assert set(changed) == set(CRITIC_ONLY)
    overrides = [f"{k}={v}" for k, v in changed.items() if v is not None] + ["critic_optim.lr=1e-3",
                                                                              "critic.updates_per_step=2"]
    with pytest.raises(ConfigError) as e:
        load_config(grpo, overrides, check_paths=False)
    msg = str(e.value)
    assert msg.startswith(f"{len(CRITIC_ONLY)} invalid settings:"), msg
    for key in CRITIC_ONLY:
        assert f"  - {key} (" in msg, (key, msg)


def test_settings_that_train_nothing_with_groups_of_one_are_refused():
    """GRPO's advantage compares a response with its group: at rollout.n_samples=1 every advantage
    is 0; dynamic sampling drops every group of one (never informative), whatever the estimator."""
    grpo = str(ROOT / "configs" / "grpo.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(grpo, ["rollout.n_samples=1"], check_paths=False)
    assert "rollout.n_samples=1 with algo.estimator=grpo trains nothing" in str(e.value), str(e.value)
    assert str(e.value).count("\n") == 0, str(e.value)  # one problem, one line
    for base in (grpo, DEMO):
        with pytest.raises(ConfigError,
                           match="rollout.dynamic_sampling=true with rollout.n_samples=1 drops every group"):
            load_config(base, ["rollout.n_samples=1", "rollout.dynamic_sampling=true"], check_paths=False)
    load_config(DEMO, ["rollout.n_samples=1"], check_paths=False)  # GAE learns from one response per prompt
    load_config(grpo, ["rollout.n_samples=2"], check_paths=False)


def test_a_run_without_a_critic_records_no_critic_settings(tmp_path):
    """A GRPO run's config.yaml (and state.json, W&B, --print-config: config.run_record) held a
    critic_optim section and the GAE settings; it holds none, and reads back as the same config."""
    import yaml

    from vapo_megatron.config import resume, run_record, to_dict
    from vapo_megatron.config.checks import CRITIC_ONLY

    run_dir = tmp_path / "run"
    grpo = load_config(str(ROOT / "configs" / "grpo.yaml"), [f"trainer.run_dir={run_dir}"], check_paths=False)
    saved = yaml.safe_load(resume.save(grpo).read_text())
    assert saved == run_record(grpo) and "critic_optim" not in saved
    assert not {"lambda_critic", "value_clip", "gamma", "alpha", "decoupled_gae"} & set(saved["algo"])
    assert "critic_hf_path" not in saved["model"] and saved["model"]["hf_path"] == grpo.model.hf_path
    assert len(CRITIC_ONLY) == 11 and saved["algo"]["estimator"] == "grpo" and "critic" not in saved
    assert parse_config(str(run_dir / "config.yaml")) == (grpo, [])  # the same configuration, no problem
    (run_dir / "checkpoints" / "iter_0000001").mkdir(parents=True)
    resume.check_resume(grpo, announce=False)  # a resume compares equal
    gae = load_config(DEMO, check_paths=False)
    assert run_record(gae) == to_dict(gae) and "critic_optim" in run_record(gae)


def test_a_resume_never_switches_the_estimator(tmp_path):
    from vapo_megatron.config import resume

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "iter_0000001").mkdir(parents=True)
    resume.save(load_config(DEMO, [f"trainer.run_dir={run_dir}"], check_paths=False))
    grpo = str(ROOT / "configs" / "grpo.yaml")
    for extra in ([], ["trainer.allow_config_change=true"]):
        cfg = load_config(grpo, [f"trainer.run_dir={run_dir}", *extra], check_paths=False)
        with pytest.raises(ConfigError, match=r"algo.estimator: 'gae' in the run .*'grpo' now; a run cannot switch"):
            resume.check_resume(cfg, announce=False)


def test_a_resume_never_changes_the_expert_parallel_size(tmp_path):
    """parallel.ep (issue 33): a checkpoint's optimizer state is laid out by EP, so another EP is
    refused in one line before anything loads, with trainer.allow_config_change too; the checkpoint
    manager refuses it again from the checkpoint's own state.json (ep_change)."""
    from vapo_megatron.config import resume
    from vapo_megatron.config.load import to_dict

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "iter_0000001").mkdir(parents=True)
    ep2 = parse_config(DEMO, [f"trainer.run_dir={run_dir}", "parallel.ep=2"])[0]
    resume.save(ep2)
    for extra in ([], ["trainer.allow_config_change=true"]):
        cfg = parse_config(DEMO, [f"trainer.run_dir={run_dir}", "parallel.ep=1", *extra])[0]
        with pytest.raises(ConfigError) as e:
            resume.check_resume(cfg, announce=False)
        assert "\n" not in str(e.value)
        assert str(e.value).startswith(f"parallel.ep: 2 in the run in {run_dir}, 1 now; a checkpoint cannot take "
                                       "another expert-parallel size"), str(e.value)
        assert str(e.value).endswith("not even with trainer.allow_config_change=true: resume with parallel.ep=2, "
                                     "or choose a new trainer.run_dir"), str(e.value)
    resume.check_resume(ep2, announce=False)  # the same EP passes
    assert resume.ep_change(to_dict(ep2), to_dict(ep2)) is None
    assert resume.ep_change({}, to_dict(ep2)).startswith("written at parallel.ep=1, not 2: a checkpoint cannot take")
    assert resume.ep_change(to_dict(ep2), to_dict(cfg)).endswith("(megatron lays the optimizer state out by EP); "
                                                                 "resume with parallel.ep=2")


def test_partial_rollout_settings_are_checked_at_start_up():
    """rollout.partial.*: every bad value in one message, each naming its key (issue 47)."""
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["rollout.partial.enabled=true", "rollout.partial.round_tokens=0",
                           "rollout.partial.max_decode_steps=0", "rollout.partial.spare_batches=-1",
                           "rollout.partial.max_staleness=0", "rollout.partial.is_cap=0.5"], check_paths=False)
    msg = str(e.value)
    assert msg.startswith("5 invalid settings:"), msg
    for text in ("rollout.partial.round_tokens=0 must be >= 1", "rollout.partial.max_decode_steps=0 must be >= 1",
                 "rollout.partial.spare_batches=-1 must be >= 0", "rollout.partial.max_staleness=0 must be >= 1",
                 "rollout.partial.is_cap=0.5 must be >= 1"):
        assert text in msg, (text, msg)
    cfg = load_config(DEMO, ["rollout.partial.enabled=true", "rollout.partial.round_tokens=8",
                             "rollout.partial.max_decode_steps=16"], check_paths=False)
    assert (cfg.rollout.partial.enabled and cfg.rollout.partial.round_tokens == 8
            and cfg.rollout.partial.max_staleness == 1)


def test_more_spare_batches_than_max_staleness_is_refused_naming_both():
    """issue 55 item 8: a group trains at most max_staleness steps after its first token, so with
    more spare batches than that in flight, steps trained several times prompts_per_step groups
    (8, 24, 8, 24 at prompts_per_step=8, spare_batches=3, max_staleness=1), with no word."""
    for enabled in ("true", "false"):  # a resume may turn it on
        with pytest.raises(ConfigError) as e:
            load_config(DEMO, [f"rollout.partial.enabled={enabled}", "rollout.partial.spare_batches=3"],
                        check_paths=False)
        assert str(e.value) == (
            "rollout.partial.spare_batches=3 must be <= rollout.partial.max_staleness=1: a group trains at most "
            "max_staleness steps after its first token, so more spare batches in flight than that make steps train "
            "more than rollout.prompts_per_step groups (up to (1 + spare_batches) x prompts_per_step at once); raise "
            "rollout.partial.max_staleness or lower rollout.partial.spare_batches"), str(e.value)
    cfg = load_config(DEMO, ["rollout.partial.enabled=true", "rollout.partial.spare_batches=3",
                             "rollout.partial.max_staleness=3"], check_paths=False)
    assert cfg.rollout.partial.spare_batches == cfg.rollout.partial.max_staleness == 3


def test_max_sampling_rounds_with_partial_rollout_is_a_bound_a_step_keeps():
    """issue 55 item 9: with partial rollout a step takes at most 1 + spare_batches prompt batches,
    so max_sampling_rounds (a step's prompts at most, in batches) is honoured when it is at least
    that, and refused, naming the keys, only when it is not; it was refused whenever it was not 10."""
    on = ["rollout.partial.enabled=true", "rollout.dynamic_sampling=true"]
    for rounds in (2, 3, 10):
        cfg = load_config(DEMO, [*on, f"rollout.max_sampling_rounds={rounds}"], check_paths=False)
        assert cfg.rollout.max_sampling_rounds == rounds
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [*on, "rollout.max_sampling_rounds=2", "rollout.partial.spare_batches=2",
                           "rollout.partial.max_staleness=2"], check_paths=False)
    assert str(e.value) == (
        "rollout.max_sampling_rounds=2 bounds a step's prompts at 2 x rollout.prompts_per_step, but with "
        "rollout.partial.enabled a step takes up to 1 + rollout.partial.spare_batches = 3 batches of prompts (to fill "
        "the groups in flight): set rollout.max_sampling_rounds >= 3 or "
        "rollout.partial.spare_batches <= 1"), str(e.value)
    load_config(DEMO, [*on[1:], "rollout.max_sampling_rounds=1"], check_paths=False)  # synchronous: its own rule


def test_eval_every_0_turns_periodic_evaluation_off():
    """issue 55 item 13: eval.every=0 means no periodic eval (before RL and at the end only)."""
    assert load_config(DEMO, ["eval.every=0"], check_paths=False).eval.every == 0
    with pytest.raises(ConfigError, match=r"eval.every=-1 must be >= 0 \(0: no periodic evaluation\)"):
        load_config(DEMO, ["eval.every=-1"], check_paths=False)


def test_missing_demo_data_names_the_command_that_writes_it(tmp_path, monkeypatch):
    """issue 63: the README's `vapo-train --config configs/demo_cpu.yaml ...` before `make demo` listed
    the four missing paths and not what makes them. The first one now names it, once; a layout that
    is not make_demo_data.py's (a model of one's own) gets no such hint."""
    from vapo_megatron.config.checks import config_problems

    monkeypatch.chdir(tmp_path)  # the configs' relative runs/... paths: none of them exists here
    problems = config_problems(parse_config(DEMO, ["trainer.run_dir=run"])[0])
    assert problems[0] == ("model.hf_path: runs/demo/data/model does not exist (written by `make demo`, which then "
                           "trains the demo, or by `python scripts/make_demo_data.py --out runs/demo/data`)")
    assert problems[1:4] == [f"{key}: runs/demo/data/{name}.jsonl does not exist"
                             for key, name in (("data.train_files", "train"), ("data.eval_files", "eval"),
                                               ("sft.files", "sft"))]
    chain = config_problems(parse_config(str(ROOT / "configs" / "chain_cpu.yaml"), ["trainer.run_dir=run"])[0])
    assert chain[0].endswith("(written by `python scripts/make_demo_data.py --out runs/chain/data`, with --task chain "
                             "for the chain task's configs)"), chain
    own = config_problems(parse_config(DEMO, ["trainer.run_dir=run", "model.hf_path=/no/such/Qwen2.5-7B"])[0])
    assert own[0] == "model.hf_path: /no/such/Qwen2.5-7B does not exist" and not any("make_demo_data" in p for p in own)


def test_the_demo_data_hint_is_only_for_that_directorys_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo" / "data" / "model").mkdir(parents=True)
    for name in ("train", "eval", "sft"):
        (tmp_path / "runs" / "demo" / "data" / f"{name}.jsonl").write_text("")
    from vapo_megatron.config.checks import config_problems

    problems = config_problems(parse_config(DEMO,
                                            ["trainer.run_dir=run", "data.eval_files=[/elsewhere/eval.jsonl]"])[0])
    assert problems == ["data.eval_files: /elsewhere/eval.jsonl does not exist"], problems


def test_a_moved_key_is_refused_naming_its_new_place_but_read_from_a_runs_own_record(tmp_path):
    """A user's file or override with a key that moved (load.MOVED_KEYS) is refused, one line naming
    where and the new key; the run directory's record written before the move reads in the new form."""
    from vapo_megatron.config import resume
    from vapo_megatron.config.load import parse_recorded

    path = _write(tmp_path, "trainer:\n  eval_every: 7\n")
    cfg, problems = parse_config(path, ["data.eval_max_prompts=3"])
    assert problems == [f"{path}: trainer.eval_every was moved to eval.every",
                        "command-line override 'data.eval_max_prompts=3': "
                        "data.eval_max_prompts was moved to eval.max_prompts"]
    assert cfg.eval.every == 10 and cfg.eval.max_prompts == 512  # nothing read from an old key
    run_dir = tmp_path / "run"
    new = parse_config(DEMO, [f"trainer.run_dir={run_dir}", "eval.every=7"])[0]
    saved = resume.save(new)
    saved.write_text(saved.read_text().replace("eval:\n  every: 7\n", "eval:\n")
                     .replace("trainer:\n", "trainer:\n  eval_every: 7\n"))
    assert "eval_every: 7" in saved.read_text()
    assert parse_recorded(str(saved)) == (new, [])
    (run_dir / "checkpoints" / "iter_0000001").mkdir(parents=True)
    resume.check_resume(new, announce=False)  # the same run
