"""`vapo-eval --engine sglang` end to end with sglang 0.5.23's own CPU engine (a colocated
sglang.Engine started by the command, the demo's model): it runs, writes its files, and its greedy
accuracy is the embedded engine's on the same prompts (greedy answers depend on the weights alone).
TEST DOUBLE: only sgl_kernel's CPU build (tests/doubles/sglang/sgl_kernel via
tests/helpers/sglang_world.py). A new user's trial once found this command dying on an internal
uvloop error (sglang installed without its dependencies)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.quiet_check import users_env
from tests.helpers.sglang_world import sglang_env
from tests.helpers.train_runs import ROOT


def _eval(demo, out, *engine: str) -> dict:
    args = ["--model", str(demo / "model"), "--data", str(demo / "eval.jsonl"), "--n-samples", "2", "--out", str(out),
            "--reward", "exact", "--max-new-tokens", "6", "--max-prompt-tokens", "32", "--seed", "3", "--greedy", *engine]
    proc = subprocess.run([sys.executable, "-m", "vapo_megatron.eval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=sglang_env({**users_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "summary.json").read_text())


def test_vapo_eval_with_sglangs_cpu_engine(demo, tmp_path):
    sglang = _eval(demo, tmp_path / "sglang", "--engine", "sglang", "--sglang-mem-fraction", "0.01")
    embedded = _eval(demo, tmp_path / "embedded", "--engine", "embedded")
    rows = [json.loads(line) for line in (tmp_path / "sglang" / "samples.jsonl").read_text().splitlines()]
    assert sglang["prompts"] == embedded["prompts"] > 0 and len(rows) == 2 * sglang["prompts"]
    assert sglang["greedy_accuracy"] == embedded["greedy_accuracy"]
