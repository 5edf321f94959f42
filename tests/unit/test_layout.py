"""The package layout keeps its rules (docs/architecture.md, "The tree"): read from the source
with ast, so a change that breaks one fails here rather than in review. The import graph counts
every import of a module, at its top, inside a function or under TYPE_CHECKING: an import deferred
into a function still makes one module need the other."""

from __future__ import annotations

import ast
import functools
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "vapo_megatron"
ENTRY_POINTS = {"train", "convert", "eval", "plan", "check"}  # the commands: vapo_megatron/<name>.py
LIBRARY_DIRS = ("vapo_megatron", "model_providers")
COMMANDS = "the commands"  # the layer of vapo_megatron/<entry point>.py
# The layers, bottom to top (docs/architecture.md, "The tree"): a module imports modules of its own
# layer and of the layers below it, never one of a layer above (except UPWARD, below).
LAYERS = (
    "vapo_megatron.runtime",     # imports nothing of the package: every layer may use it
    "vapo_megatron.tasks",       # the synthetic tasks (demo, chain): imports nothing of the package
    "model_providers",           # what a model family is: pure Python, no megatron
    "vapo_megatron.config",      # the schema and every check of it, start-up
    "vapo_megatron.data",        # prompts, datasets, batches, routes, the carry-over buffer
    "vapo_megatron.algorithms",  # VAPO's math on tensors
    "vapo_megatron.mcore",       # Megatron-Core: process groups, models, optimizer, the two roles
    "vapo_megatron.checkpoint",  # the run's checkpoints of those models
    "vapo_megatron.weights",     # HF <-> Megatron tensors, vapo-convert's library part
    "vapo_megatron.rollout",     # engines, generation, weight sync
    "vapo_megatron.rewards",     # verifiers and step 3's scorer
    "vapo_megatron.evaluation",  # evals over the engines and verifiers
    "vapo_megatron.sizing",      # vapo-plan's models of memory and time, over the models' shapes
    "vapo_megatron.trainer",     # the loop, which uses all of the above
    "vapo_megatron.nodecheck",   # vapo-check's checks of a GPU node, over every layer below
    COMMANDS,                    # train.py, convert.py, eval.py, plan.py, check.py
)
# The upward imports allowed, each with its reason: (importer, imported) -> why. Each imported
# module uses nothing above its importer's layer but its own folder's lower modules.
UPWARD: dict[tuple[str, str], str] = {
    ("vapo_megatron.config.quiet", "vapo_megatron.mcore.megatron_import"):
        "device_startup imports megatron-core before any other module can, through the module that "
        "imports it without torch.compile on the CPU; megatron_import.py imports nothing of the package",
    ("vapo_megatron.config.preflight", "vapo_megatron.rewards.pool"):
        "the start-up checks import reward.fn with the resolver the reward workers use (one meaning of "
        "a 'module:function' spec); pool.py imports nothing of the package",
    ("vapo_megatron.mcore.model", "vapo_megatron.weights.hf_read"):
        "a trained model is built with its HF weights cut to this rank's shards; hf_read.py needs only "
        "mcore's process groups and models, the family's table and weights/params.py",
    ("vapo_megatron.checkpoint.model_state", "vapo_megatron.weights.hf_write"):
        "a trainer checkpoint carries the files vapo-convert's hf-to-mcore writes beside the weights "
        "(write_source_files), so every Megatron checkpoint exports alike; hf_write.py needs only the "
        "runtime, mcore's process groups and the family registry",
}


def _py_files(*dirs: str) -> list[Path]:
    return [p for d in dirs for p in sorted((ROOT / d).rglob("*.py"))]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # every test reads the same files: each is parsed once
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


@functools.cache
def _import_graph() -> dict[str, dict[str, int]]:
    """{module: {module it imports: first line}} over the library's modules. `from pkg import name`
    is an import of pkg.name when that is a module, else of pkg (its __init__)."""
    modules = {_module(p): p for p in _py_files(*LIBRARY_DIRS)}
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for module, names, line in _imports(path):
            for target in [f"{module}.{n}" for n in names if f"{module}.{n}" in modules] or [module]:
                if target in modules and target != name:
                    edges.setdefault(target, line)
    return graph


def _layer(module: str) -> int | None:
    """The index of a module's layer in LAYERS; None for the package's own __init__."""
    if module == "vapo_megatron":
        return None
    if module.count(".") == 1 and module.split(".")[1] in ENTRY_POINTS:
        return LAYERS.index(COMMANDS)
    for i, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS")


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_every_module_has_a_layer_and_every_layer_modules():
    graph = _import_graph()
    layers = {_layer(m) for m in graph} - {None}
    assert layers == set(range(len(LAYERS))), [LAYERS[i] for i in set(range(len(LAYERS))) - layers]
    assert not graph["vapo_megatron"], "vapo_megatron/__init__.py imports nothing (a docstring only)"


def test_no_circle_of_imports():
    cycles = _cycles(_import_graph())
    assert not cycles, "modules that import each other (directly or round a circle): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_imports_run_down_the_layers():
    graph = _import_graph()
    upward = {(a, b): line for a, edges in graph.items() for b, line in edges.items()
              if _layer(a) is not None and _layer(b) > _layer(a)}
    bad = [f"{a.replace('.', '/')}.py:{line} imports {b} ({LAYERS[_layer(a)]} < {LAYERS[_layer(b)]})"
           for (a, b), line in sorted(upward.items()) if (a, b) not in UPWARD]
    assert not bad, f"{len(bad)} imports of a layer above: " + "; ".join(bad)
    stale = sorted(set(UPWARD) - set(upward))
    assert not stale, f"allowed upward imports that no longer exist: {stale}"
    for a, b in UPWARD:  # what an allowed one brings along stays below its importer, or in its own layer
        seen, todo = set(), [b]
        while todo:
            for c in graph[todo.pop()]:
                if c not in seen:
                    seen.add(c)
                    todo.append(c)
        above = sorted(c for c in seen if _layer(c) > _layer(a) and _layer(c) != _layer(b))
        assert not above, f"{a} imports {b}, which brings {above} of layers above {LAYERS[_layer(a)]}"


def test_no_product_module_imports_test_machinery():
    """Product code (the package, model_providers/, scripts/, benchmarks/) imports nothing of tests/:
    test doubles, helpers and fault injection reach a run only from the tests' side."""
    bad = []
    for path in _py_files("vapo_megatron", "model_providers", "scripts", "benchmarks"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not bad, bad


def test_product_files_name_no_test_files():
    """The package reads on its own: a comment says why, not which test checks it (issue 64)."""
    import re

    pattern = re.compile(r"\btests/|\btest_\w+\.py")
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in _py_files(*LIBRARY_DIRS)
           for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not bad, bad


def test_the_tasks_import_nothing_of_the_package():
    """tasks/ sits at the bottom of the layers so that `make demo`'s data script, the studies and
    vapo-check may all use it: it must stay free of the package's other layers."""
    bad = [f"{a} imports {b}" for a, edges in _import_graph().items() if a.startswith("vapo_megatron.tasks")
           for b in edges if not b.startswith("vapo_megatron.tasks")]
    assert not bad, bad


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


# The process-group module and its two parts, which only it imports: roles.py keeps the critic's
# own layout beside the actor's (critic.parallel), fake_ranks.py vapo-plan's one-rank fake launch.
PROCESS_GROUP_PARTS = ["vapo_megatron/mcore/fake_ranks.py", "vapo_megatron/mcore/roles.py"]


def test_only_the_process_group_module_uses_megatrons_parallel_state():
    users = [str(p.relative_to(ROOT)) for p in _py_files(*LIBRARY_DIRS)
             if any(m.startswith("megatron.core") and ("parallel_state" in m or "parallel_state" in names)
                    for m, names, _ in _imports(p))]
    assert sorted(users) == sorted(["vapo_megatron/mcore/parallel.py", *PROCESS_GROUP_PARTS]), users
    parts = {p.removesuffix(".py").replace("/", ".") for p in PROCESS_GROUP_PARTS}
    importers = sorted(str(p.relative_to(ROOT)) for p in _py_files(*LIBRARY_DIRS)
                       if any(m in parts or (m == "vapo_megatron.mcore" and set(names) & {"roles", "fake_ranks"})
                              for m, names, _ in _imports(p)))
    assert importers == ["vapo_megatron/mcore/parallel.py"], importers


def test_no_file_refers_to_anything_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert len(tracked) > 50
    # The development machine's paths that users do not have (spelled in parts, so that this
    # file does not name them itself).
    outside = ("/".join(("..", "shared")), "/" + "work/")
    bad = [f for f in tracked if (ROOT / f).is_file()
           and any(o in (ROOT / f).read_text(errors="replace") for o in outside)]
    assert not bad, bad
