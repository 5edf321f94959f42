"""vapo_megatron/config/package_index.py: the packages_distributions the commands give transformers
is the standard library's mapping, on this environment and on a made-up distribution without a
top_level.txt (a package, a module, its dist-info and a script outside site-packages in its RECORD),
computed without a stat per file. In a fresh interpreter: the standard library's is the reference."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.train_runs import ROOT

PROBE = """
import importlib.metadata as md, sys
from vapo_megatron.config import package_index
want = md.packages_distributions()  # the standard library's, before install()
package_index.install()
assert md.packages_distributions is package_index.packages_distributions
have = md.packages_distributions()
assert have == want, sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
assert have["torch"] == ["torch"] and have["toyplug"] == ["toy-dist"] and have["toymod"] == ["toy-dist"]
assert "toy_dist-1.0.dist-info" not in have and ".." not in have
print("ok")
"""


def test_same_mapping_as_the_standard_library(tmp_path):
    site = tmp_path / "site"
    info = site / "toy_dist-1.0.dist-info"
    (site / "toyplug").mkdir(parents=True)
    info.mkdir()
    (site / "toyplug" / "__init__.py").write_text("")
    (site / "toymod.py").write_text("")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-dist\nVersion: 1.0\n")
    (info / "RECORD").write_text("toyplug/__init__.py,,\ntoymod.py,,\n\"toy_dist-1.0.dist-info/METADATA\",,\n"
                                 "toy_dist-1.0.dist-info/RECORD,,\n../../bin/toy,,\n")
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{site}"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
