"""How the commands answer bad input: one message and exit 2, never a traceback.

    code = answer("vapo-convert", lambda: run(args), bad_input=(CheckpointError, ...))

`bad_input` (plus OSError: a path that cannot be read or written is the user's to fix) prints
"PROG: error: MESSAGE" and returns BAD_INPUT_EXIT_CODE; a message that lists several problems
keeps its one line per problem. Anything else is a bug, answered with one line too, exit 1, so a
user never faces a traceback; VAPO_VERBOSE=1 prints the traceback as well, in both cases. Ctrl-C
is one line and exit 130. Under torchrun every rank answers, prefixed with its rank, because an
error may be one rank's alone. Pure Python.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

BAD_INPUT_EXIT_CODE = 2
BUG_EXIT_CODE = 1
INTERRUPTED_EXIT_CODE = 130  # the shell's code for a SIGINT death


def verbose() -> bool:
    return os.environ.get("VAPO_VERBOSE", "") not in ("", "0")


def say(prog: str, message: str) -> None:
    """One message to stderr, naming the command (and the rank under a multi-rank launcher)."""
    rank = f"[rank {os.environ.get('RANK')}] " if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else ""
    print(f"{rank}{prog}: {message}", file=sys.stderr, flush=True)


def answer(prog: str, body: Callable[[], int | None], *, bad_input: tuple[type[BaseException], ...] = ()) -> int:
    """Run `body`; its return value (None: 0) or the exit code of what it raised."""
    try:
        return body() or 0
    except SystemExit:
        raise  # argparse's usage errors (exit 2) and explicit exits keep their own answer
    except KeyboardInterrupt:
        say(prog, "interrupted")
        return INTERRUPTED_EXIT_CODE
    except (*bad_input, OSError) as e:
        if verbose():
            traceback.print_exc()
        say(prog, f"error: {str(e).strip() or type(e).__name__}")
        return BAD_INPUT_EXIT_CODE
    except Exception as e:  # noqa: BLE001 - a bug: one line, the traceback on request
        if verbose():
            traceback.print_exc()
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        say(prog, f"internal error: {type(e).__name__}" + (f": {lines[-1].strip()}" if lines else "")
            + ("" if verbose() else " (VAPO_VERBOSE=1 prints the traceback)"))
        return BUG_EXIT_CODE


__all__ = ["BAD_INPUT_EXIT_CODE", "BUG_EXIT_CODE", "INTERRUPTED_EXIT_CODE", "answer", "say", "verbose"]
