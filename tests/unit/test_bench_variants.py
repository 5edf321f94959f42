"""The learning benchmark's variant table (benchmarks/learning/studies.yaml; issue 31): every row is a valid
configuration on the base config, switches what it names and nothing else, and the grpo rows drop the base's
critic-only keys (which a grpo config refuses) by writing the base YAML without them."""

from __future__ import annotations

from pathlib import Path

import pytest

import benchmarks.learning.cli as bench
from benchmarks.learning.variants import STUDIES, STUDIES_FILE, load_definitions
from vapo_megatron.config.load import flatten, load_config, to_dict

ROOT = Path(__file__).resolve().parents[2]

BASE = ROOT / "configs" / "chain_cpu.yaml"


def resolved(variant: str, tmp_path: Path) -> dict:
    sets, unset = bench.resolve(variant, bench.base_settings(BASE, []))
    path = tmp_path / f"{variant}.yaml"
    path.write_text(bench.derived_yaml(BASE, unset))
    return flatten(to_dict(load_config(str(path), sets, check_paths=False)))


@pytest.mark.parametrize("variant", list(bench.VARIANTS))
def test_every_variant_is_a_valid_config(variant, tmp_path):
    resolved(variant, tmp_path)


def test_each_row_switches_only_its_component_and_keeps_the_sample_budget(tmp_path):
    vapo = resolved("vapo", tmp_path)
    budget = vapo["rollout.prompts_per_step"] * vapo["rollout.n_samples"]
    for variant in bench.VARIANTS:
        got = resolved(variant, tmp_path)
        changed = {k for k in vapo if got[k] != vapo[k]}
        # the rows that double the budget, on purpose (DAPO's generation)
        if variant in ("grpo_dapo_volume", "vapo_dapo_volume"):
            assert got["rollout.prompts_per_step"] * got["rollout.n_samples"] == 2 * budget
            continue  # what else it changes: test_the_volume_follow_up_...
        assert got["rollout.prompts_per_step"] * got["rollout.n_samples"] == budget, variant
        assert not changed & {"actor_optim.lr", "trainer.total_steps", "sft.steps", "rollout.temperature"}, variant
        if variant == "no_clip_higher":
            assert changed == {"algo.eps_high"} and got["algo.eps_high"] == got["algo.eps_low"]
        if variant == "no_group_sampling":
            assert changed == {"rollout.n_samples", "rollout.prompts_per_step"} and got["rollout.n_samples"] == 1
    van = resolved("vanilla_ppo", tmp_path)
    assert (van["algo.value_pretrain_steps"], van["algo.decoupled_gae"], van["algo.length_adaptive"],
            van["algo.loss_agg"], van["algo.nll_coef"], van["rollout.n_samples"]) == (0, False, False, "sample", 0, 1)


def test_grpo_rows_reset_the_critic_only_keys_to_their_defaults(tmp_path):
    for variant in ("grpo", "dapo"):
        got = resolved(variant, tmp_path)
        assert got["algo.estimator"] == "grpo" and got["algo.alpha"] == 0.05  # the schema default, not the base's 1.0
    assert resolved("dapo", tmp_path)["rollout.dynamic_sampling"] is True


def test_the_critic_studys_arms_switch_what_the_preregistration_says(tmp_path):
    """docs/benchmarks.md, "What does the critic buy?": each arm against vapo or vapo_no_critic."""
    vapo, no_critic = resolved("vapo", tmp_path), resolved("vapo_no_critic", tmp_path)
    assert no_critic == resolved("grpo", tmp_path)  # the issue-31 row under the study's name

    def changed(variant, base):
        got = resolved(variant, tmp_path)
        return {k: got[k] for k in base if got[k] != base[k]}

    assert changed("grpo_paper", no_critic) == {"algo.eps_high": 0.2, "algo.loss_agg": "sample", "algo.nll_coef": 0.0}
    assert changed("vapo_whiten", vapo) == {"algo.whiten_advantages": True}
    assert changed("vapo_lambda1", vapo) == {"algo.length_adaptive": False, "algo.lambda_policy": 1.0}
    assert changed("vapo_vp0", vapo) == {"algo.value_pretrain_steps": 0}
    assert changed("vapo_vp50", vapo) == {"algo.value_pretrain_steps": 50}
    assert changed("vapo_critic_4x", vapo) == {}  # its critic trunk is the harness's model.critic_hf_path
    study = STUDIES["critic"]
    assert len(study["seeds"]) >= 5 and 0 not in study["seeds"]  # not the docs' data seed 0
    assert all(v in bench.VARIANTS for v in study["primary"] + study["mechanism"])


def test_the_volume_follow_up_shares_the_critic_studys_warm_starts_and_runs(tmp_path):
    study, critic = STUDIES["volume"], STUDIES["critic"]
    assert study["seeds"] == critic["seeds"] and set(study["primary"]) - {"grpo_dapo_volume"} <= set(critic["primary"])
    no_critic, got = resolved("vapo_no_critic", tmp_path), resolved("grpo_dapo_volume", tmp_path)
    assert ({k: got[k] for k in no_critic if got[k] != no_critic[k]}
            == {"rollout.prompts_per_step": 2 * no_critic["rollout.prompts_per_step"]})


def test_partial_rollout_rows_are_their_rows_with_partial_rollout_on(tmp_path):
    for row in ("vapo", "dapo"):
        base, got = resolved(row, tmp_path), resolved(f"{row}_partial", tmp_path)
        changed = {k for k in base if got[k] != base[k]}
        assert changed == {"rollout.partial.enabled", "rollout.partial.round_tokens"}, changed
        assert got["rollout.partial.round_tokens"] == base["rollout.max_new_tokens"] // 3


def test_the_positive_controls_arms_change_only_what_they_name(tmp_path):
    """docs/benchmarks.md, "Can any critic help?": each new arm against its reference arm."""
    vapo, no_critic, dapo = resolved("vapo", tmp_path), resolved("vapo_no_critic", tmp_path), resolved("dapo", tmp_path)

    def changed(variant, base):
        got = resolved(variant, tmp_path)
        return {k: got[k] for k in base if got[k] != base[k]}

    # The oracle: vapo's settings exactly; what differs is the program (its critic role), and only it.
    assert changed("vapo_oracle", vapo) == {} and bench.VARIANTS["vapo_oracle"]["entry"] == "scripts/bench_oracle.py"
    assert [v for v in bench.VARIANTS if "entry" in bench.VARIANTS[v]] == ["vapo_oracle"]
    assert changed("dr_grpo", no_critic) == {"algo.grpo_std_norm": False}
    assert changed("dapo_paper", dapo) == {"algo.nll_coef": 0.0,
                                           "reward.overlong_buffer": vapo["rollout.max_new_tokens"] // 5}
    assert changed("vapo_dapo_volume", vapo) == {"rollout.prompts_per_step": 2 * vapo["rollout.prompts_per_step"]}
    study = STUDIES["oracle"]
    assert all(v in bench.VARIANTS for v in study["primary"]) and study["primary"][:2] == ["vapo", "vapo_no_critic"]
    assert all(a in study["primary"] and b in study["primary"] for a, b in study["pairs"] + study["secondary_pairs"])


def test_the_single_answer_studys_arms_change_only_what_they_name(tmp_path):
    """docs/benchmarks.md, "Where should a critic pay?": vapo_n1 is vapo at one answer per prompt,
    batch_n1 the value-free batch baseline at the same shape, both at 128 answers a step as grpo and vapo."""
    vapo, grpo = resolved("vapo", tmp_path), resolved("grpo", tmp_path)
    n1 = {"rollout.n_samples": 1,
          "rollout.prompts_per_step": vapo["rollout.prompts_per_step"] * vapo["rollout.n_samples"]}

    def changed(variant, base):
        got = resolved(variant, tmp_path)
        return {k: got[k] for k in base if got[k] != base[k]}

    assert changed("vapo_n1", vapo) == n1
    assert changed("batch_n1", grpo) == n1 | {"algo.estimator": "batch"}
    study = STUDIES["single"]
    assert study["primary"] == ["vapo_n1", "batch_n1", "grpo", "vapo"] and study["rules"] == "single" and study["holm"]
    assert study["pairs"] == [("vapo_n1", "batch_n1"), ("vapo_n1", "grpo"), ("vapo_n1", "vapo")]
    used = {s for other, st in STUDIES.items() if other != "single" for s in st["seeds"]}
    assert len(study["seeds"]) == 10 and not used & set(study["seeds"])  # warm starts no earlier study used


@pytest.mark.parametrize("old, new, names", [
    ("primary: [vapo, vapo_no_critic, grpo_paper, dapo]", "primary: [vapo, vapo_no_critc, grpo_paper, dapo]",
     "studies.critic: arms vapo_no_critc are not variants"),
    ("vapo_critic_4x: {set: [], critic: 4x}", "vapo_critic_4x: {set: [], critic: 8x}",
     "variants.vapo_critic_4x.critic: '8x'"),
    ("pairs: [[vapo_partial, vapo], [dapo_partial, dapo]]", "pairs: [[vapo_partial, grpo], [dapo_partial, dapo]]",
     "studies.partial.pairs: every pair is [a, b], two of the study's arms"),
    ("entry: scripts/bench_oracle.py", "entry: scripts/no_such.py", "variants.vapo_oracle.entry"),
])
def test_a_bad_studies_file_is_refused_naming_the_file_and_key(old, new, names, tmp_path):
    bad = tmp_path / "studies.yaml"
    bad.write_text(STUDIES_FILE.read_text().replace(old, new, 1))
    with pytest.raises(ValueError) as e:
        load_definitions(bad)
    assert str(e.value).startswith(f"{bad}: ") and names in str(e.value), e.value
