"""The package layout keeps its rules (docs/architecture.md, "The tree"): read from the source
with ast, so a change that breaks one fails here rather than in review."""

from __future__ import annotations

import ast
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "vapo_megatron"
ENTRY_POINTS = {"train", "convert", "eval", "plan", "check"}  # the commands: vapo_megatron/<name>.py
LIBRARY_DIRS = ("vapo_megatron", "model_providers")


def _py_files(*dirs: str) -> list[Path]:
    return [p for d in dirs for p in sorted((ROOT / d).rglob("*.py"))]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of every import in a file (the project writes absolute imports only)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import"
            out.append((node.module, [a.name for a in node.names], node.lineno))
    return out


def test_top_level_holds_only_the_commands():
    modules = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    assert modules == ENTRY_POINTS, modules
    assert len(modules) <= 5
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {f"vapo-{e}": f"vapo_megatron.{e}:main" for e in ENTRY_POINTS}, scripts  # each one installed


def test_every_folder_opens_with_a_docstring_of_what_it_holds():
    packages = [p for p in _py_files(*LIBRARY_DIRS, "tests", "benchmarks") if p.name == "__init__.py"]
    assert len(packages) >= 15
    missing = [str(p.relative_to(ROOT)) for p in packages if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"packages without a docstring: {missing}"


def test_no_file_exceeds_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _py_files(*LIBRARY_DIRS, "tests", "scripts", "benchmarks")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_library_modules_never_import_a_command():
    commands = {f"vapo_megatron.{e}" for e in ENTRY_POINTS}
    bad = []
    for path in _py_files(*LIBRARY_DIRS):
        if _module(path) in commands:
            continue
        for module, names, line in _imports(path):
            hit = module in commands or (module == "vapo_megatron" and set(names) & ENTRY_POINTS)
            if hit:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module} {names}")
    assert not bad, bad


def test_no_private_name_is_imported_across_modules():
    ours = ("vapo_megatron", "model_providers", "tests", "benchmarks")
    bad = []
    for path in _py_files(*LIBRARY_DIRS, "tests", "scripts", "benchmarks"):
        for module, names, line in _imports(path):
            if module.split(".")[0] not in ours:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {private} from {module}")
    assert not bad, bad


def test_only_the_process_group_module_uses_megatrons_parallel_state():
    users = [str(p.relative_to(ROOT)) for p in _py_files(*LIBRARY_DIRS)
             if any(m.startswith("megatron.core") and ("parallel_state" in m or "parallel_state" in names)
                    for m, names, _ in _imports(p))]
    assert users == ["vapo_megatron/mcore/parallel.py"], users


def test_no_file_refers_to_anything_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert len(tracked) > 50
    # The development machine's paths that users do not have (spelled in parts, so that this
    # file does not name them itself).
    outside = ("/".join(("..", "shared")), "/" + "work/")
    bad = [f for f in tracked if (ROOT / f).is_file()
           and any(o in (ROOT / f).read_text(errors="replace") for o in outside)]
    assert not bad, bad
