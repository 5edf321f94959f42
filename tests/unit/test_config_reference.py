"""docs/config.md is the configuration reference a user reads: generated from the schema
(vapo_megatron/config/reference.py), it lists every key with its type, default and meaning, and
stays current. `vapo-train --print-config` prints a resolved configuration without building
anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from vapo_megatron.config import Config, load_config, to_dict
from vapo_megatron.config.load import flatten
from vapo_megatron.config.reference import DOC, render

ROOT = Path(__file__).resolve().parents[2]


def _rows() -> dict[str, list[str]]:
    """{key: [type, default, meaning]} of docs/config.md's tables."""
    rows = {}
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.replace("\\|", "\x00").strip("|").split("|")]
            rows[cells[0].strip("`")] = [c.replace("\x00", "|") for c in cells[1:]]
    return rows


def test_docs_config_md_is_what_the_schema_generates():
    assert DOC.read_text() == render(), (
        "docs/config.md is out of date with vapo_megatron/config/schema.py: "
        "run python -m vapo_megatron.config.reference")


def test_every_key_is_listed_with_its_default_and_a_meaning():
    rows = _rows()
    keys = flatten(to_dict(Config()))
    missing = sorted(set(keys) - set(rows))
    assert not missing, f"keys missing from docs/config.md: {missing}"
    no_meaning = [k for k in keys if not rows[k][2]]
    assert not no_meaning, f"keys without a comment in schema.py (their meaning in docs/config.md): {no_meaning}"
    wrong = {k: (rows[k][1], v) for k, v in keys.items() if json.loads(rows[k][1].strip("`")) != v}
    assert not wrong, f"defaults in docs/config.md differ from the schema's: {wrong}"
    assert rows["critic_optim.lr"][1] == "`2e-06`"  # a section's own default (Config's), not the class's


def _print_config(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VAPO_RUN_DIR"} | {"PYTHONPATH": str(ROOT)}
    code = ("import sys; from vapo_megatron.train import main; rc = main(sys.argv[1:]); "
            "sys.stderr.write('torch imported\\n' if 'torch' in sys.modules else ''); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, "--print-config", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_print_config_prints_the_resolved_yaml_and_builds_nothing(tmp_path):
    run_dir = tmp_path / "never-created"
    proc = _print_config("--config", "configs/demo_cpu.yaml", f"trainer.run_dir={run_dir}",
                         "trainer.wandb.mode=offline", "model.hf_path=/nonexistent/model")
    assert proc.returncode == 0, proc.stderr
    assert "torch imported" not in proc.stderr
    printed = yaml.safe_load(proc.stdout)
    expected = to_dict(load_config("configs/demo_cpu.yaml", [f"trainer.run_dir={run_dir}", "trainer.wandb.mode=offline",
                                                              "model.hf_path=/nonexistent/model"], check_paths=False))
    assert printed == expected
    assert printed["trainer"]["wandb"]["mode"] == "offline" and printed["critic_optim"]["lr"] == 1e-3
    assert not run_dir.exists()


def test_print_config_answers_bad_settings_in_one_message():
    proc = _print_config("--config", "configs/demo_cpu.yaml", "trainer.wandb.mode=sometimes", "algo.gama=1")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("vapo-train: configuration error: 2 invalid settings"), proc.stderr
    assert "trainer.wandb.mode='sometimes'" in proc.stderr and "algo.gama" in proc.stderr
    assert "Traceback" not in proc.stderr
