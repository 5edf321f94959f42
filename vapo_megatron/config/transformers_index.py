"""transformers' lazy-import table, read once per installed transformers instead of once per process.

`import transformers` (5.x, transformers/__init__.py) builds the table of what every model module
exports: utils/import_utils.py's define_import_structure reads all ~3,000 files under
transformers/models/ and scans each for `__all__`, about 1 s of CPU in every process that imports
it, which is every rank of every command here. The table is a pure function of those files.

`install()` adds an import hook for this process: when transformers.utils.import_utils has been
executed, and before transformers/__init__ uses it, its define_import_structure is wrapped. Then a
table for a folder inside the installed transformers is read from a JSON file in the user's cache
folder, written the first time. The file is keyed by transformers' version and the folder's path
and modification time. An unreadable or mismatched file is rebuilt, and a cache folder that cannot
be written only costs the time it would have saved.

The suite checks that the cached table equals transformers' own, and that a stale or damaged
file is rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import os
import sys
import tempfile
from pathlib import Path

TARGET = "transformers.utils.import_utils"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vapo-megatron"


def _encode(structure: dict) -> list:
    return [[sorted(backends), {module: sorted(names) for module, names in table.items()}]
            for backends, table in structure.items()]


def _decode(rows: list) -> dict:
    return {frozenset(backends): {module: set(names) for module, names in table.items()} for backends, table in rows}


def cached(define, root: Path):
    """define_import_structure, with tables of folders under `root` (transformers' package) kept on disk."""
    version = importlib.metadata.version("transformers")

    @functools.wraps(define)
    def define_import_structure(module_path, prefix=None):
        path = Path(module_path)
        folder = path if path.is_dir() else path.parent
        try:
            folder.resolve().relative_to(root)
            stamp = folder.stat().st_mtime_ns
        except (ValueError, OSError):
            return define(module_path, prefix)
        key = {"transformers": version, "path": str(path.resolve()), "prefix": prefix, "mtime_ns": stamp}
        digest = hashlib.sha256(f"{key['path']}\0{prefix}".encode()).hexdigest()[:16]
        name = f"transformers-{version}-import-structure-{digest}.json"
        file = cache_dir() / name
        try:
            saved = json.loads(file.read_text())
            if saved["key"] == key:
                return _decode(saved["table"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        table = define(module_path, prefix)
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=file.parent, delete=False, suffix=".tmp") as f:
                json.dump({"key": key, "table": _encode(table)}, f)
            os.replace(f.name, file)  # whole or absent: ranks starting at once may race here
        except OSError:
            pass
        return table

    return define_import_structure


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        root = Path(module.__file__).resolve().parents[1]  # transformers/
        module.define_import_structure = cached(module.define_import_structure, root)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """The hook, for this process; nothing if transformers is already imported (too late to help)
    or the hook is in place."""
    if TARGET in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


__all__ = ["cache_dir", "cached", "install"]
