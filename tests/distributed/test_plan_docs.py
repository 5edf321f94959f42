"""The docs' vapo-plan printouts are what vapo-plan prints today (issue 44 item 15: docs/slurm.md
had drifted, 29.64 against 29.66 GiB, a reserve line missing).

Every `$ vapo-plan ...` line inside a fenced block of README.md or docs/*.md is run, from the
repository root, and its output (stdout, then stderr) compared with the lines under it up to the
next `$ ` line or the fence: lines between `...` lines must appear together and in order; the
block starts at the output's first line unless it opens with `...`, and ends at its last unless
it closes with `...`. Trailing spaces do not count. All commands run in one spawned process
(vapo-plan activates cpu_compat and a fake process group, which must not leak into pytest).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import shlex
from pathlib import Path

from tests.helpers.dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[2]
ELIDED = "..."


def documented_runs() -> list[tuple[str, list[str], list[str]]]:
    """(where, argv, the lines shown under it) of every `$ vapo-plan` in a fenced block."""
    runs = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fenced, current = False, None
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            if line.startswith("```"):
                fenced, current = not fenced, None
            elif fenced and line.startswith("$ "):
                current = None
                if line.startswith("$ vapo-plan "):
                    current = (f"{doc.relative_to(ROOT)}:{lineno}", shlex.split(line)[2:], [])
                    runs.append(current)
            elif fenced and current is not None:
                current[2].append(line.rstrip())
    return runs


def shown_in(shown: list[str], output: list[str]) -> bool:
    """Whether the block's lines are the output's, with `...` for lines left out (module docstring)."""
    segments, part = [], []
    for line in shown:
        if line == ELIDED:
            segments.append(part)
            part = []
        else:
            part.append(line)
    segments.append(part)
    pos = 0
    for k, seg in enumerate(segments):
        if not seg:
            continue
        starts = [i for i in range(pos, len(output) - len(seg) + 1) if output[i:i + len(seg)] == seg]
        if k == 0:
            starts = [i for i in starts if i == 0]
        if k == len(segments) - 1:
            starts = [i for i in starts if i + len(seg) == len(output)]
        if not starts:
            return False
        pos = starts[0] + len(seg)
    return True


def _plan_all(arg_lists: list[list[str]]) -> list[list[str]]:
    from vapo_megatron.plan import main

    os.chdir(ROOT)  # the docs' paths are relative to the repository
    out = []
    for args in arg_lists:
        o, e = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            main(args)
        out.append([line.rstrip() for line in (o.getvalue() + e.getvalue()).splitlines()])
    return out


def test_every_documented_vapo_plan_printout_is_the_commands_output():
    runs = documented_runs()
    assert len(runs) >= 9 and all(shown for _, _, shown in runs), runs  # docs/slurm.md alone shows nine
    (outputs,) = run_ranks(1, _plan_all, [argv for _, argv, _ in runs])
    stale = []
    for (where, argv, shown), output in zip(runs, outputs):
        if not shown_in(shown, output):
            diff = "\n".join(difflib.unified_diff(shown, output, "the docs", "vapo-plan now", lineterm="", n=1))
            stale.append(f"{where}: vapo-plan {shlex.join(argv)}\n{diff}")
    assert not stale, "printouts that differ from the command's output:\n\n" + "\n\n".join(stale)


def test_the_comparison_rule():
    out = ["a", "b", "c", "d", "e"]
    assert shown_in(out, out) and shown_in(["a", "b", ELIDED, "e"], out) and shown_in([ELIDED, "c", ELIDED], out)
    assert shown_in([ELIDED, "b", ELIDED, "d", "e"], out) and shown_in(["a", ELIDED], out)
    assert not shown_in(["a", "b", "c", "d"], out)       # the end is not the output's end
    assert not shown_in(["b", ELIDED, "e"], out)          # nor the start its start
    assert not shown_in(["a", "c", ELIDED], out)          # a segment's lines are together
    assert not shown_in([ELIDED, "d", ELIDED, "b", ELIDED], out)  # and in order
    assert not shown_in(["a", "b", "x", "c", "d", "e"], out)
