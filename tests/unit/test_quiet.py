"""config/quiet.py: the compile-time SyntaxWarning of an installed library's source (printed when
Python first compiles it, since setup_env.sh installs without byte-compiling) stays off the screen,
and the same warning from a file outside site-packages (the user's own code) still shows. In a
fresh interpreter: warnings filters are process-wide."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.train_runs import ROOT

PROBE = """
import sys
sys.path[:0] = [{lib!r}, {own!r}]
from vapo_megatron.config.quiet import quiet_startup
quiet_startup()
import escaped_lib, escaped_own
"""


def test_a_librarys_syntax_warning_is_quiet_and_the_users_is_not(tmp_path):
    lib, own = tmp_path / "venv" / "lib" / "python3.12" / "site-packages", tmp_path / "work"
    for folder, name in ((lib, "escaped_lib"), (own, "escaped_own")):
        folder.mkdir(parents=True)
        (folder / f"{name}.py").write_text('PATTERN = "a\\-b"\n')  # an invalid escape: \-
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE.format(lib=str(lib), own=str(own))], cwd=tmp_path,
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "SyntaxWarning" in line]
    assert len(warned) == 1 and "escaped_own.py" in warned[0], proc.stderr
