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


def test_torchs_all_gather_into_tensor_deprecation_is_quiet():
    """megatron-core gathers with torch.distributed.all_gather_into_tensor (its MoE token dispatch at
    EP > 1, sequence-parallel gathers), which torch 2.11 deprecates with a FutureWarning: every rank
    printed it once. The real function is called (it warns before it looks for a process group)."""
    import warnings

    import torch
    import torch.distributed as dist

    from vapo_megatron.config.quiet import quiet_startup

    with warnings.catch_warnings(record=True) as caught:  # the filters come off again afterwards
        warnings.simplefilter("always")
        quiet_startup()
        try:
            dist.all_gather_into_tensor(torch.zeros(2), torch.zeros(1))
        except (RuntimeError, ValueError):
            pass  # no process group: the warning, if any, came first
        warnings.warn("`torch.distributed.something_else` is deprecated.", FutureWarning)  # other texts still show
    texts = [str(w.message) for w in caught]
    assert not [t for t in texts if "all_gather_into_tensor" in t], texts
    assert "`torch.distributed.something_else` is deprecated." in texts, texts
