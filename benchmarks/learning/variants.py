"""The learning benchmark's rows and studies (python -m benchmarks.learning; issues 31 and 45),
read from studies.yaml (beside this file, which says what each field means) and checked once.

    VARIANTS            each row: dotted overrides on the base config ("set"), base keys to drop ("unset"),
                        and "critic": a trunk of its own for the critic (a key of CRITIC_MODELS)
    STUDIES             a pre-registered design: seeds, primary and mechanism arms, vapo-eval's K
    load_definitions(f) (VARIANTS, CRITIC_MODELS, STUDIES) of a studies file; a bad one is one line naming its key
    resolve(v, base)    (overrides, unset keys) of a row, placeholders filled from the base settings
    run_problems(...)   what the trainer's own config checks refuse in one run's settings
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml

from vapo_megatron.config.checks import CRITIC_ONLY as CRITIC_ONLY_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
STUDIES_FILE = Path(__file__).with_name("studies.yaml")


class BadInput(Exception):
    """A flag, setting or earlier run the harness refuses: one line, exit 2, before any work."""


# The value-free rows drop every critic-only key of the base config (algo.estimator=grpo refuses them).
CRITIC_ONLY = list(CRITIC_ONLY_SETTINGS)
VARIANT_KEYS, STUDY_KEYS = {"set", "unset", "critic", "entry"}, {
    "seeds", "primary", "mechanism", "pairs", "secondary_pairs", "holm", "share", "rules", "eval_k", "summaries"}


def load_definitions(path: Path) -> tuple[dict[str, dict], dict[str, list[str]], dict[str, dict]]:
    """(variants, critic models, studies) of a studies file, as the harness uses them: a variant's
    "unset: CRITIC_ONLY" the critic-only keys, a study's pairs tuples. Anything malformed or
    unknown raises ValueError naming the file and the key."""
    data = yaml.safe_load(path.read_text())

    def bad(key: str, why: str):
        raise ValueError(f"{path}: {key}: {why}")

    def strings(key: str, value) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            bad(key, f"{value!r} is not a list of strings")
        return value

    if not isinstance(data, dict) or set(data) != {"variants", "critic_models", "studies"}:
        bad("top level", "needs exactly the keys variants, critic_models, studies")
    models = {name: strings(f"critic_models.{name}", args) for name, args in data["critic_models"].items()}
    variants = {}
    for name, row in data["variants"].items():
        if not isinstance(row, dict) or "set" not in row or set(row) - VARIANT_KEYS:
            bad(f"variants.{name}", f"needs 'set', may have {', '.join(sorted(VARIANT_KEYS - {'set'}))}")
        if any("=" not in s for s in strings(f"variants.{name}.set", row["set"])):
            bad(f"variants.{name}.set", "every item is key=value")
        if "unset" in row:
            row["unset"] = (CRITIC_ONLY if row["unset"] == "CRITIC_ONLY"
                            else strings(f"variants.{name}.unset", row["unset"]))
        if "critic" in row and row["critic"] not in models:
            bad(f"variants.{name}.critic", f"{row['critic']!r} is not one of critic_models ({', '.join(models)})")
        if "entry" in row and not (ROOT / str(row["entry"])).is_file():
            bad(f"variants.{name}.entry", f"{row['entry']!r} is not a file of the repository")
        variants[name] = row
    studies = {}
    for name, study in data["studies"].items():
        if not isinstance(study, dict) or set(study) - STUDY_KEYS or {"seeds", "primary", "mechanism", "eval_k",
                                                                           "summaries"} - set(study):
            bad(f"studies.{name}", "needs seeds, primary, mechanism, eval_k, summaries; may have pairs, "
                                   "secondary_pairs, holm, share, rules")
        arms = (strings(f"studies.{name}.primary", study["primary"])
                + strings(f"studies.{name}.mechanism", study["mechanism"]))
        if unknown := [a for a in arms if a not in variants]:
            bad(f"studies.{name}", f"arms {', '.join(unknown)} are not variants")
        for key in ("pairs", "secondary_pairs"):
            if key in study:
                if not all(isinstance(p, list) and len(p) == 2 and set(p) <= set(arms) for p in study[key]):
                    bad(f"studies.{name}.{key}", "every pair is [a, b], two of the study's arms")
                study[key] = [tuple(p) for p in study[key]]
        if "share" in study:
            if len(study["share"]) != 3 or not set(study["share"]) <= set(arms):
                bad(f"studies.{name}.share", "is [learned, oracle, free], three of the study's arms")
            study["share"] = tuple(study["share"])
        if study.get("rules") not in (None, "critic", "oracle", "single"):
            bad(f"studies.{name}.rules", f"{study['rules']!r} is none of critic, oracle, single")
        if study.get("rules") == "single" and len(study.get("pairs", [])) < 3:
            bad(f"studies.{name}.pairs", "rules single reads three pairs: critic-free, critic-grpo, critic-group")
        studies[name] = study
    return variants, models, studies


VARIANTS, CRITIC_MODELS, STUDIES = load_definitions(STUDIES_FILE)


def has_critic(variant: str) -> bool:
    """A learned critic, whose checkpoint the credit diagnostics read (the oracle's is no model):
    asked of the row's estimator's record (vapo_megatron/config/estimators.py)."""
    from vapo_megatron.config.estimators import ESTIMATORS

    chosen = [s.split("=", 1)[1] for s in VARIANTS[variant]["set"] if s.startswith("algo.estimator=")]
    return ESTIMATORS[chosen[-1] if chosen else "gae"].needs_critic and "entry" not in VARIANTS[variant]


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
    data = yaml.safe_load(config.read_text()) or {}
    for key in unset:
        *parents, last = key.split(".")
        node = data
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return (f"# {config} with {', '.join(unset) or 'nothing'} removed (scripts/bench_learning.py)\n"
            + yaml.safe_dump(data, sort_keys=False))


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
