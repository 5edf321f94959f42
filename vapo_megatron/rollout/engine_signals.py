"""The trainer's signal handling around a colocated SGLang engine living in its own process.

sglang.Engine (0.5.23) changes the handlers of the process that owns it:
  - at start-up (sglang/srt/entrypoints/engine.py, _set_envs_and_config) it installs a SIGQUIT
    handler that kills the whole process tree, unless ServerArgs.custom_sigquit_handler is set;
  - on the first call that reaches its TokenizerManager (sglang/srt/managers/tokenizer_manager.py,
    auto_create_handle_loop) it adds asyncio handlers on its event loop for SIGTERM (drain the
    requests, then shut the engine down) and SIGQUIT (running_phase_sigquit_handler:
    kill_process_tree of this very process), replacing whatever the process had;
  - its SubprocessWatchdog (sglang/srt/utils/watchdog.py) sends SIGQUIT to this process when a
    scheduler process dies, and a failing scheduler does the same.
In the trainer that meant: Slurm's SIGTERM never reached trainer/signals.py (no checkpoint before
the kill), and a dead scheduler killed the trainer without a word about which engine died.

Here: every call on the Engine runs inside `kept_handlers`, which puts back what the process had
for SIGTERM, SIGINT, SIGUSR1 and SIGQUIT before the call (the engine loop's own registrations are
removed, so its SIGTERM drain never runs); and SIGQUIT is an `EngineDeath`, passed to SGLang as
its custom_sigquit_handler and kept in force the same way, which raises `EngineDied` naming the
engine: a clear fatal error, after which the process exits and sglang.Engine's atexit shutdown
ends the engine's processes.
"""

from __future__ import annotations

import contextlib
import signal
import threading

# The signals whose handlers the trainer owns (trainer/signals.py) or this module sets.
KEPT = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGQUIT)


class EngineDied(RuntimeError):
    """A colocated SGLang engine lost one of its processes; the message names the engine."""


class EngineDeath:
    """SIGQUIT handler for the process that owns engine `name`: raises EngineDied, and remembers
    it, so a later call on the engine fails the same way even if the first error was caught."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.signalled = False

    def message(self) -> str:
        return (f"{self.name} died: one of its processes sent SIGQUIT (SGLang's SubprocessWatchdog "
                "or a failing scheduler; its own error is in the log above). The run stops here; resume "
                "from the last checkpoint.")

    def __call__(self, signum, frame) -> None:
        self.signalled = True
        raise EngineDied(self.message())

    def check(self) -> None:
        if self.signalled:
            raise EngineDied(self.message())

    def install(self) -> "EngineDeath":
        """SIGQUIT -> this handler (signal handlers can only be set from the main thread)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, self)
        return self


def _engine_loops(engine) -> list:
    """The asyncio loops an sglang.Engine may have registered signal handlers on: Engine.loop and
    its TokenizerManager's event_loop (the same loop when the call ran inside the Engine's)."""
    loops: list = []
    for obj in (engine, getattr(engine, "tokenizer_manager", None)):
        for attr in ("loop", "event_loop"):
            loop = getattr(obj, attr, None)
            if loop is not None and hasattr(loop, "remove_signal_handler") and loop not in loops:
                loops.append(loop)
    return loops


def restore_handlers(engine, before: dict) -> list[str]:
    """Put `before` ({signal: handler}) back where the engine changed it; returns the names of the
    signals that had to be restored."""
    restored = []
    for signum, handler in before.items():
        if signal.getsignal(signum) is handler:
            continue
        for loop in _engine_loops(engine):
            with contextlib.suppress(Exception):  # not registered there, or the loop is closed
                loop.remove_signal_handler(signum)
        if handler is not None:  # None: a handler not installed from Python; nothing to put back
            signal.signal(signum, handler)
        restored.append(signal.Signals(signum).name)
    return restored


@contextlib.contextmanager
def kept_handlers(engine):
    """Around a call on `engine` (or its start, engine=None): the process's handlers of KEPT
    signals are the same after the call as before it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers are per process and set from the main thread only: nothing to guard here
        return
    before = {s: signal.getsignal(s) for s in KEPT}
    try:
        yield
    finally:
        restore_handlers(engine, before)


__all__ = ["EngineDeath", "EngineDied", "KEPT", "kept_handlers", "restore_handlers"]
