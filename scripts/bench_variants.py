"""The learning benchmark's rows and studies (scripts/bench_learning.py; issues 31 and 45).

    VARIANTS            each row: dotted overrides on the base config ("set"), base keys to drop ("unset"),
                        and "critic": a trunk of its own for the critic (a key of CRITIC_MODELS)
    STUDIES             a pre-registered design: seeds, primary and mechanism arms, vapo-eval's K
    resolve(v, base)    (overrides, unset keys) of a row, placeholders filled from the base settings
    run_problems(...)   what the trainer's own config checks refuse in one run's settings
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from vapo_megatron.config.checks import CRITIC_ONLY as CRITIC_ONLY_SETTINGS  # noqa: E402


class BadInput(Exception):
    """A flag, setting or earlier run the harness refuses: one line, exit 2, before any work."""


# The value-free rows drop every critic-only key of the base config (algo.estimator=grpo refuses them).
CRITIC_ONLY = list(CRITIC_ONLY_SETTINGS)
NO_CRITIC = ["algo.estimator=grpo", "algo.value_pretrain_steps=0"]
VARIANTS: dict[str, dict] = {
    "vapo": {"set": []},
    "no_value_pretrain": {"set": ["algo.value_pretrain_steps=0"]},
    "no_decoupled_gae": {"set": ["algo.decoupled_gae=false"]},
    "no_length_adaptive": {"set": ["algo.length_adaptive=false", "algo.lambda_policy=0.95"]},
    "no_clip_higher": {"set": ["algo.eps_high=EPS_LOW"]},
    "no_token_loss": {"set": ["algo.loss_agg=sample"]},
    "no_nll": {"set": ["algo.nll_coef=0"]},
    "no_group_sampling": {"set": ["rollout.n_samples=1", "rollout.prompts_per_step=PROMPTS_X_GROUP"]},
    "vanilla_ppo": {"set": ["algo.value_pretrain_steps=0", "algo.decoupled_gae=false", "algo.length_adaptive=false",
                            "algo.lambda_policy=0.95", "algo.eps_high=EPS_LOW", "algo.loss_agg=sample",
                            "algo.nll_coef=0", "rollout.n_samples=1", "rollout.prompts_per_step=PROMPTS_X_GROUP"]},
    "grpo": {"set": NO_CRITIC, "unset": CRITIC_ONLY},
    "dapo": {"set": [*NO_CRITIC, "rollout.dynamic_sampling=true", "reward.overlong_buffer=OVERLONG"], "unset": CRITIC_ONLY},
    # The critic study (issue 45). vapo_no_critic is grpo's row under the study's name.
    "vapo_no_critic": {"set": NO_CRITIC, "unset": CRITIC_ONLY},
    "grpo_paper": {"set": [*NO_CRITIC, "algo.eps_high=EPS_LOW", "algo.loss_agg=sample", "algo.nll_coef=0"],
                   "unset": CRITIC_ONLY},
    "vapo_whiten": {"set": ["algo.whiten_advantages=true"]},
    "vapo_lambda1": {"set": ["algo.length_adaptive=false", "algo.lambda_policy=1.0"]},
    "vapo_vp0": {"set": ["algo.value_pretrain_steps=0"]},
    "vapo_vp50": {"set": ["algo.value_pretrain_steps=50"]},
    "vapo_critic_4x": {"set": [], "critic": "4x"},
    # The critic study's follow-up (docs/benchmarks.md, "At DAPO's generation"): GRPO generating and
    # training on as many samples per step as DAPO generates (2x the prompts), the same 50 steps.
    "grpo_dapo_volume": {"set": [*NO_CRITIC, "rollout.prompts_per_step=PROMPTS_X2"], "unset": CRITIC_ONLY},
    # The positive control (issue 54; docs/benchmarks.md, "Can any critic help?"). vapo_oracle is vapo's
    # settings run by scripts/bench_oracle.py ("entry"), whose critic role is the chain task's oracle.
    "vapo_oracle": {"set": [], "entry": "scripts/bench_oracle.py"},
    "dr_grpo": {"set": [*NO_CRITIC, "algo.grpo_std_norm=false"], "unset": CRITIC_ONLY},
    # DAPO as its paper ran it (arXiv 2503.14476): no positive-example LM loss, an overlong buffer of
    # a fifth of the longest answer (4,096 of 20,480 tokens); the study's `dapo` keeps both of VAPO's.
    "dapo_paper": {"set": [*NO_CRITIC, "rollout.dynamic_sampling=true", "reward.overlong_buffer=OVERLONG_PAPER",
                           "algo.nll_coef=0"], "unset": CRITIC_ONLY},
    "vapo_dapo_volume": {"set": ["rollout.prompts_per_step=PROMPTS_X2"]},
}
# Partial rollout's learning parity (issue 47; docs/benchmarks.md): each of these rows with
# rollout.partial on, rounds of a third of the longest answer so that responses do carry over.
for _row in ("vapo", "dapo"):
    VARIANTS[f"{_row}_partial"] = {"set": VARIANTS[_row]["set"] + ["rollout.partial.enabled=true",
                                                                   "rollout.partial.round_tokens=ROUND"],
                                   "unset": VARIANTS[_row].get("unset", [])}
# A critic trunk of its own: make_demo_data.py's size flags (after the --data-args, so they win)
# for a random-init model of the seed, given the same warm start as the actor before RL.
CRITIC_MODELS = {"4x": ["--hidden-size", "128", "--ffn-size", "512"]}  # 747k parameters against 189k
STUDIES = {
    "critic": {  # docs/benchmarks.md, "What does the critic buy?"
        "seeds": [101, 102, 103, 104, 105],
        "primary": ["vapo", "vapo_no_critic", "grpo_paper", "dapo"],
        "mechanism": ["vapo_whiten", "vapo_lambda1", "vapo_vp0", "vapo_vp50", "vapo_critic_4x"],
        "rules": "critic",  # its decision rules are applied in the report (bench_learning_report.decisions)
        "eval_k": 8,
        "summaries": "docs/benchmarks/critic",
    },
    # Partial rollout's learning parity (issue 47; docs/benchmarks.md, "Learning parity"): the
    # critic study's first three warm starts, so its vapo and dapo runs are shared; read with-minus-without.
    "partial": {
        "seeds": [101, 102, 103],
        "primary": ["vapo", "vapo_partial", "dapo", "dapo_partial"],
        "mechanism": [],
        "pairs": [("vapo_partial", "vapo"), ("dapo_partial", "dapo")],
        "eval_k": 8,
        "summaries": "docs/benchmarks/partial",
    },
    # The critic study's follow-up, designed after its results (so exploratory; docs/benchmarks.md,
    # "At DAPO's generation"): its five warm starts, its dapo, vapo_no_critic and vapo runs shared.
    "volume": {
        "seeds": [101, 102, 103, 104, 105],
        "primary": ["dapo", "grpo_dapo_volume", "vapo_no_critic", "vapo"],
        "mechanism": [],
        "pairs": [("dapo", "grpo_dapo_volume"), ("grpo_dapo_volume", "vapo_no_critic"), ("vapo", "grpo_dapo_volume")],
        "eval_k": 8,
        "summaries": "docs/benchmarks/volume",
    },
    # The positive control (issue 54; docs/benchmarks.md, "Can any critic help?"), designed before its
    # runs: ten warm starts; the five primary comparisons ("pairs") are read under Holm's correction
    # ("holm"); "share": how much of the oracle's gain over the value-free arm the learned critic
    # captures, (a - c) / (b - c), read only if the oracle's gain resolves ("rules": oracle_decisions).
    "oracle": {
        "seeds": [101, 102, 103, 104, 105, 106, 107, 108, 109, 110],
        "primary": ["vapo", "vapo_no_critic", "vapo_oracle", "dr_grpo", "dapo_paper", "vapo_dapo_volume"],
        "mechanism": [],
        "pairs": [("vapo_oracle", "vapo_no_critic"), ("vapo", "vapo_no_critic"), ("vapo", "vapo_oracle"),
                  ("dr_grpo", "vapo_no_critic"), ("vapo", "dapo_paper")],
        "secondary_pairs": [("vapo_dapo_volume", "vapo"), ("vapo_dapo_volume", "dapo_paper"),
                            ("vapo_dapo_volume", "vapo_no_critic")],
        "holm": True,
        "share": ("vapo", "vapo_oracle", "vapo_no_critic"),
        "rules": "oracle",
        "eval_k": 8,
        "summaries": "docs/benchmarks/oracle",
    },
}


def has_critic(variant: str) -> bool:
    """A learned critic, whose checkpoint the credit diagnostics read (the oracle's is no model)."""
    return "algo.estimator=grpo" not in VARIANTS[variant]["set"] and "entry" not in VARIANTS[variant]


def base_settings(config: Path, overrides: list[str]) -> dict:
    """The base config's resolved settings, --set overrides applied (schema defaults filled in)."""
    from vapo_megatron.config.load import parse_config, to_dict

    if not config.is_file():
        raise BadInput(f"--config {config}: no such file")
    cfg, problems = parse_config(str(config), overrides)
    if problems:
        raise BadInput(f"{config}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return to_dict(cfg)


def resolve(variant: str, base: dict) -> tuple[list[str], list[str]]:
    """(overrides, unset keys) of a variant, its placeholders filled from the base settings."""
    r, a = base["rollout"], base["algo"]
    fill = {"EPS_LOW": str(a["eps_low"]), "PROMPTS_X_GROUP": str(r["prompts_per_step"] * r["n_samples"]),
            "OVERLONG": str(max(1, r["max_new_tokens"] // 8)), "PROMPTS_X2": str(2 * r["prompts_per_step"]),
            "ROUND": str(max(1, r["max_new_tokens"] // 3)), "OVERLONG_PAPER": str(max(1, r["max_new_tokens"] // 5))}
    out = []
    for item in VARIANTS[variant]["set"]:
        key, value = item.split("=", 1)
        out.append(f"{key}={fill.get(value, value)}")
    return out, list(VARIANTS[variant].get("unset", []))


def derived_yaml(config: Path, unset: list[str]) -> str:
    """The base config's YAML text without the unset keys (a dropped key takes its default)."""
    import yaml

    data = yaml.safe_load(config.read_text()) or {}
    for key in unset:
        *parents, last = key.split(".")
        node = data
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return f"# {config} with {', '.join(unset) or 'nothing'} removed (scripts/bench_learning.py)\n" + yaml.safe_dump(data, sort_keys=False)


def run_problems(config: Path, unset: list[str], overrides: list[str], nproc: int) -> list[str]:
    """What vapo-train would refuse in these settings before it reads a file: the value checks,
    the layout against `nproc` ranks and the batch sizes against data parallelism (files and
    models do not exist yet: they are checked when the run starts)."""
    from vapo_megatron.config.checks import config_problems
    from vapo_megatron.config.layout import layout_problems
    from vapo_megatron.config.load import parse_config
    from vapo_megatron.config.preflight import batch_problems

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(derived_yaml(config, unset))
        f.flush()
        cfg, problems = parse_config(f.name, overrides)
    problems += config_problems(cfg, check_paths=False)
    p = cfg.parallel
    problems += [m for m in layout_problems(nproc, p.tp, p.pp, p.vpp, ep=p.ep) if m not in problems]
    if p.tp >= 1 and p.pp >= 1 and nproc % (p.tp * p.pp) == 0:
        problems += batch_problems(cfg, nproc // (p.tp * p.pp))
    return problems
