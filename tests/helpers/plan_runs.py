"""vapo-plan's main in this process, its output captured: for a rank of dist_utils.run_ranks, since
vapo-plan activates cpu_compat and a fake process group, which must not leak into pytest's."""

from __future__ import annotations

import contextlib
import io
import warnings


def plan_outputs(arg_lists: list[list[str]]) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of `vapo-plan ARGS` for each argument list. Warnings are recorded
    into stderr's text: the user's terminal would show them there."""
    from vapo_megatron.plan import main

    out = []
    for args in arg_lists:
        o, e = io.StringIO(), io.StringIO()
        with (contextlib.redirect_stdout(o), contextlib.redirect_stderr(e),
              warnings.catch_warnings(record=True) as caught):
            rc = main(args)
        out.append((rc, o.getvalue(), e.getvalue() + "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)))
    return out
