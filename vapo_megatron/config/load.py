"""Configuration from a YAML file and dotted command-line overrides, every problem at once.

    cfg = load_config("configs/demo_cpu.yaml", ["trainer.total_steps=5", "algo.nll_coef=0"])

`parse_config` reads the file and the overrides into the schema and returns the problems it
found (YAML, an override that is not key=value, unknown keys, wrong types); a field with a
problem keeps its default, so the value checks (checks.py, layout.py) can still run and a user
sees every problem of a command in one pass. Pure Python: vapo-train runs all of this before it
imports torch or megatron-core.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from vapo_megatron.config.schema import Config, ConfigError, problems_error

# Keys that moved, old -> new: in a user's file or override one is refused, in one line naming its
# new key (parse_config); in a run's own record (run_dir/config.yaml, written before the move) its
# value is read under the new key (parse_recorded), so the run still resumes. Same meaning, new place.
MOVED_KEYS = {
    "trainer.eval_every": "eval.every", "data.eval_max_prompts": "eval.max_prompts",
    # an engine's settings are its own section (config/engines.py)
    "rollout.sglang_tp": "rollout.sglang.tp", "rollout.sglang_mem_fraction": "rollout.sglang.mem_fraction",
    "rollout.sglang_max_total_tokens": "rollout.sglang.max_total_tokens",
    "rollout.sglang_urls": "rollout.sglang_http.urls",
}


def _from_dict(cls, data: dict, path: str, errors: list[str], base=None):
    """Build dataclass `cls` from a plain dict, starting from `base` (the section's default as
    its parent declares it: critic_optim's lr differs from actor_optim's) or cls(). Unknown keys
    and wrong types are appended to `errors` (all of them, not just the first); their fields keep
    the default."""
    defaults = cls() if base is None else base
    if not isinstance(data, dict):
        errors.append(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
        return defaults
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = f"{path}." if path else ""
    for name in sorted(set(data) - set(fields)):
        errors.append(f"unknown config key {where}{name} (allowed: {', '.join(sorted(fields))})")
    kwargs = {}
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    for name, value in data.items():
        if name not in fields:
            continue
        key = f"{where}{name}"
        default = getattr(defaults, name)
        if dataclasses.is_dataclass(default):
            kwargs[name] = _from_dict(type(default), value or {}, key, errors, base=default)
            continue
        if default is None and isinstance(value, dict) and (section := _optional_section(cls, name)) is not None:
            kwargs[name] = _from_dict(section, value, key, errors)  # a section that may be null (critic.parallel)
            continue
        try:
            kwargs[name] = _coerce(value, default, hints[name], key)
        except ConfigError as e:
            errors.append(str(e))
    return dataclasses.replace(defaults, **kwargs)


def _optional_section(cls, name: str):
    """The dataclass of a field declared `Section | None` (null by default), else None."""
    import typing

    hint = typing.get_type_hints(cls)[name]
    found = [t for t in typing.get_args(hint) if dataclasses.is_dataclass(t)]
    return found[0] if found else None


def _coerce(value, default, hint: str, key: str):
    allowed = hint.split("Literal[", 1)[1].rsplit("]", 1)[0] if "Literal[" in hint else None
    if allowed is not None:
        options = [o.strip().strip("'\"") for o in allowed.split(",")]
        if value not in options:
            raise ConfigError(f"{key}={value!r} is not allowed (choose one of: {', '.join(options)})")
        return value
    if value is None:
        if "None" in hint:
            return None
        raise ConfigError(f"{key} may not be null")
    if isinstance(default, tuple) or hint.startswith("tuple"):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(str(v) for v in value)
    if "bool" in hint:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):  # YAML's .nan and .inf: every range check would let nan through
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if hint.startswith("str"):
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    return value


def _read_yaml(path: str) -> dict:
    """The file's sections. A file that cannot be read is the one error (ConfigError, one line):
    the schema's defaults checked in its place would only add follow-on errors."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"{path}: invalid YAML at {where}{getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def _dotlist(overrides: list[str], problems: list[str]) -> list[str]:
    """The overrides that are `section.key=value`; a bare key or section is a problem (OmegaConf
    would read `algo.value_clip` as null and `algo` as an empty section, silently)."""
    good = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"command-line override {item!r} must be key=value (e.g. trainer.total_steps=10)")
        else:
            good.append(item)
    return good


def _pop(tree: dict, key: str) -> tuple[bool, object]:
    """(found, value) of dotted `key` in nested dicts, removed from them when found."""
    *parents, leaf = key.split(".")
    for part in parents:
        tree = tree.get(part)
        if not isinstance(tree, dict):
            return False, None
    return (True, tree.pop(leaf)) if leaf in tree else (False, None)


def _moved_in_file(data: dict, path: str, problems: list[str]) -> None:
    """Each moved key the file sets: one problem naming the file and the new key (dropped from `data`)."""
    for old, new in MOVED_KEYS.items():
        if _pop(data, old)[0]:
            problems.append(f"{path}: {old} was moved to {new}")


def _moved_override(item: str, problems: list[str]) -> bool:
    """True (and one problem naming the new key) when override `item` sets a moved key."""
    key = item.partition("=")[0].strip()
    if key in MOVED_KEYS:
        problems.append(f"command-line override {item!r}: {key} was moved to {MOVED_KEYS[key]}")
    return key in MOVED_KEYS


def translate_record(data: dict) -> dict:
    """A run's own record written before keys moved (MOVED_KEYS), in the new form: each moved key's
    value under its new key (where the record does not set that already). Only for what the run
    itself wrote (parse_recorded): a user's file or override with an old key is refused."""
    for old, new in MOVED_KEYS.items():
        found, value = _pop(data, old)
        if not found:
            continue
        *parents, leaf = new.split(".")
        node = data
        for part in parents:
            if node.get(part) is None:  # absent, or an empty section (YAML reads it as null)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):  # not a section: the parser says so
                break
        else:
            node.setdefault(leaf, value)
    return data


def parse_recorded(path: str) -> tuple[Config, list[str]]:
    """(config, problems) of a run's recorded configuration (run_dir/config.yaml), written by any
    version of the trainer: parse_config of the record in the new form (translate_record)."""
    problems: list[str] = []
    return _build(translate_record(_read_yaml(path)), [], problems, None), problems


def parse_config(path: str | None, overrides: list[str] = (), *,
                 fallbacks: dict[str, str] | None = None) -> tuple[Config, list[str]]:
    """(config, problems): the YAML file with the `a.b.c=value` overrides applied (values typed as
    YAML), as the frozen schema. `fallbacks` maps dotted keys to a launcher's values that apply
    only where neither the file nor an override sets the key (the Slurm job's run dir: the user's
    choice wins). Fields with a problem keep their defaults; a moved key (MOVED_KEYS) is refused."""
    problems: list[str] = []
    data = _read_yaml(path) if path is not None else {}
    _moved_in_file(data, path, problems)
    overrides = [item for item in overrides if not _moved_override(item, problems)]
    return _build(data, overrides, problems, fallbacks), problems


def _build(data: dict, overrides: list[str], problems: list[str], fallbacks: dict[str, str] | None) -> Config:
    """The schema from the file's tree and the overrides; their problems appended to `problems`."""
    merged = OmegaConf.create(data)
    for item in _dotlist(list(overrides), problems):
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            problems.append(f"bad command-line override {item!r}: {str(e).splitlines()[0]}")
    for key, value in (fallbacks or {}).items():
        if OmegaConf.select(merged, key) is None:
            OmegaConf.update(merged, key, value)
    return _from_dict(Config, OmegaConf.to_container(merged, resolve=True), "", problems)


def load_config(path: str | None, overrides: list[str] = (), *, check_paths: bool = True,
                fallbacks: dict[str, str] | None = None) -> Config:
    """parse_config, then every value check that needs neither the launch nor the files' contents
    (checks.config_problems and the layout's own values); one ConfigError listing everything.
    check_paths=False skips the checks that model and data paths exist (vapo-plan sizes a run on
    a machine that has neither)."""
    from vapo_megatron.config.checks import config_problems
    from vapo_megatron.config.layout import layout_problems

    cfg, problems = parse_config(path, overrides, fallbacks=fallbacks)
    problems += config_problems(cfg, check_paths=check_paths)
    problems += layout_problems(None, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, ep=cfg.parallel.ep)
    if problems:
        raise problems_error(problems)
    return cfg


def to_dict(cfg: Config) -> dict:
    """The settings as plain YAML/JSON types (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def run_record(cfg: Config) -> dict:
    """The settings as a run records them (run_dir/config.yaml, each checkpoint's state.json, the W&B
    run's config, --print-config): to_dict without those the run has no use for (checks.py
    unused_settings: a run without a critic has no critic_optim). They are held at their defaults,
    so the record read back is the same configuration."""
    from vapo_megatron.config.checks import unused_settings

    tree = to_dict(cfg)
    for key in unused_settings(cfg):
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node[part]
        del node[leaf]
    return tree


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}: the dotted keys users write."""
    out: dict[str, object] = {}
    for k, v in tree.items():
        out |= flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out
