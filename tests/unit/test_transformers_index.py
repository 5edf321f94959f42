"""vapo_megatron/config/transformers_index.py: transformers' lazy-import table from a disk cache
is the table transformers builds itself; a stale or damaged cache file is rebuilt, not trusted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import transformers
from transformers.utils import import_utils

from vapo_megatron.config import transformers_index

ROOT = Path(transformers.__file__).resolve().parent
MODELS = ROOT / "models"


def _original():
    define = import_utils.define_import_structure
    return getattr(define, "__wrapped__", define)  # this process may have the hook installed


def test_cached_table_equals_transformers_own_and_stale_or_damaged_files_are_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    define = _original()
    want = define(MODELS, "models")
    calls = []

    def counted(*args):
        calls.append(args)
        return define(*args)

    cached = transformers_index.cached(counted, ROOT)
    assert cached(MODELS, "models") == want and len(calls) == 1  # built and written
    (file,) = (tmp_path / "vapo-megatron").glob("transformers-*-import-structure-*.json")
    assert cached(MODELS, "models") == want and len(calls) == 1  # read back, not rebuilt
    saved = json.loads(file.read_text())
    saved["key"]["mtime_ns"] -= 1  # the folder changed since: stale
    saved["table"] = []
    file.write_text(json.dumps(saved))
    assert cached(MODELS, "models") == want and len(calls) == 2
    file.write_text("{not json")
    assert cached(MODELS, "models") == want and len(calls) == 3
    # A folder outside transformers is never cached.
    other = tmp_path / "elsewhere"
    other.mkdir()
    cached(other, None)
    assert calls[-1] == (other, None) and len(list((tmp_path / "vapo-megatron").glob("*.json"))) == 1


def test_a_process_with_the_hook_imports_transformers_and_writes_the_cache(tmp_path):
    code = ("from vapo_megatron.config import transformers_index; transformers_index.install();"
            "from transformers import AutoConfig, Qwen2ForCausalLM;"
            "from transformers.utils import import_utils;"
            "print(hasattr(import_utils.define_import_structure, '__wrapped__'), Qwen2ForCausalLM.__name__)")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    for _ in range(2):  # the second process reads what the first wrote
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.split() == ["True", "Qwen2ForCausalLM"], out.stderr[-2000:]
    assert list((tmp_path / "vapo-megatron").glob("transformers-*-import-structure-*.json"))
