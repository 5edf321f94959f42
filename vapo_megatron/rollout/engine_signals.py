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
its custom_sigquit_handler and kept in force the same way. A death during an engine call ends that
call with `EngineDied` naming the engine (SGLangEngine._call); a death between calls (the trainer
training or writing a checkpoint) is recorded and raised by the next call, so it never fails a
checkpoint save that does not need the engine.

The engine's own processes (scheduler, detokenizer: spawned by sglang.Engine, in the trainer's
process group) are born with the trainer's stop signals blocked (`spared_from_stop_signals`): a
terminal's Ctrl-C reaches the whole foreground process group and Slurm signals every process of
the job step, and SGLang's processes have no handler of their own, so SIGINT (KeyboardInterrupt)
and SIGTERM killed them; the engine died under the trainer that was about to checkpoint. They still
die with the trainer: SGLang sets PR_SET_PDEATHSIG (SIGKILL) in each of them
(utils/common.py kill_itself_when_parent_died), and SIGKILL cannot be blocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading

# The signals whose handlers the trainer owns (trainer/signals.py) or this module sets.
KEPT = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGQUIT)


class EngineDied(RuntimeError):
    """A colocated SGLang engine lost one of its processes; the message names the engine."""


class EngineDeath:
    """SIGQUIT handler for the process that owns engine `name`: remembers the death, so that every
    later call on the engine fails with EngineDied, and ends a call in progress (`calling`).

    Outside a call it raises nothing: the signal lands wherever the main thread is, and an exception
    there (in megatron's checkpoint writer, say) turned a dead engine into a failed save blamed on
    the file system. During a call the main thread is usually inside the engine's event loop
    (uvloop, SGLang's policy), which runs Python signal handlers as one of its callbacks and only
    logs an exception raised there; the call then waited for ever on the dead scheduler's answer.
    So the handler stops that loop, and the call, its run_until_complete ended, raises EngineDied."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.signalled = False
        self.calls = 0  # engine calls (or the engine's start) in progress

    def message(self) -> str:
        return (f"{self.name} died: one of its processes sent SIGQUIT (SGLang's SubprocessWatchdog "
                "or a failing scheduler; its own error is in the log above). The run stops here; resume "
                "from the last checkpoint.")

    def __call__(self, signum, frame) -> None:
        self.signalled = True
        if not self.calls:
            return  # between calls: the next one raises (check)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # in the call but outside its loop (starting, serializing): raise right here
            raise EngineDied(self.message()) from None
        loop.stop()  # run_until_complete returns; the call raises EngineDied (calling)

    def check(self) -> None:
        if self.signalled:
            raise EngineDied(self.message())

    @contextlib.contextmanager
    def calling(self):
        """Around one call on the engine (or its start): a death during it ends it with EngineDied,
        whatever the engine's own code made of the signal or of its stopped loop."""
        self.check()
        self.calls += 1
        try:
            yield
        except Exception as e:
            if self.signalled:
                raise EngineDied(self.message()) from e
            raise
        finally:
            self.calls -= 1
        self.check()  # died as the call returned: its loop is stopped, the next call would fail anyway

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


def _remove_from(loop, signum: int) -> None:
    """Drop `loop`'s handler of `signum`. uvloop (SGLang's loop policy) removes one only while the loop
    runs: on a loop that is not running, remove_signal_handler returns False and keeps the handler
    (uvloop/loop.pyx, `if not self._listening_signals`), and every later run hands that signal to it
    again, whatever the process's handler is. So SGLang's SIGTERM drain stayed registered after each
    call and ran beside the trainer's handler on a SIGTERM during a later call: the engine shut itself
    down (its scheduler exiting 0, which its watchdog does not report) under the trainer's stop
    checkpoint, which then waited for ever. Outside a run the removal runs inside the loop."""
    if loop.is_closed():
        return
    if loop.is_running():
        loop.remove_signal_handler(signum)
        return

    async def remove():
        loop.remove_signal_handler(signum)

    loop.run_until_complete(remove())


def restore_handlers(engine, before: dict) -> list[str]:
    """Put `before` ({signal: handler}) back where the engine changed it; returns the names of the
    signals that had to be restored."""
    restored = []
    for signum, handler in before.items():
        if signal.getsignal(signum) is handler:
            continue
        for loop in _engine_loops(engine):
            with contextlib.suppress(Exception):  # not registered there
                _remove_from(loop, signum)
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


def take_over_now(engine) -> None:
    """Right after the engine starts: SGLang's takeover of SIGTERM and SIGQUIT
    (TokenizerManager.auto_create_handle_loop, which otherwise runs inside the Engine's first call),
    done and undone at once. During that first call (a weight sync's begin, the start-up release)
    a SIGTERM went to SGLang's handler, which starts draining and shutting the engine down, and
    never reached the trainer's; here the window is a few statements long. The function returns at
    once when it has run before; objects without a tokenizer manager (test doubles) are left alone.

    It runs inside the Engine's loop, as in the Engine's own calls (TokenizerManager's async methods
    call it first): outside a running loop it makes a loop of its own (get_or_create_event_loop),
    and its task that reads the scheduler's answers then lived on a loop that never runs, so the
    first real call waited for ever."""
    manager, loop = getattr(engine, "tokenizer_manager", None), getattr(engine, "loop", None)
    if manager is None or loop is None or not hasattr(manager, "auto_create_handle_loop"):
        return

    async def take_over():
        manager.auto_create_handle_loop()

    with kept_handlers(engine):
        loop.run_until_complete(take_over())


# What the trainer stops on and its helpers must not die of (trainer/signals.py): Ctrl-C (SIGINT, to
# the terminal's whole foreground process group) and SIGTERM (scancel and preemption: Slurm signals
# every process of the step). SIGUSR1 is blocked process-wide by StopSignals.install already.
SPARED = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def spared_from_stop_signals():
    """Around the start of an engine (or of whatever may start a helper its calls need: torch's
    torch_shm_manager, sglang_engine.serialize_flattened_bucket): the processes it spawns are born
    with SPARED blocked. A child
    inherits its spawning thread's signal mask across fork and exec (a handler it would not: exec
    resets those to the default action, which for both is to die), and a blocked signal stays
    pending, never acted on; SGLang's processes never unblock them and are ended with SIGKILL
    (Engine.shutdown, PR_SET_PDEATHSIG). In this process the mask is this thread's only, and only
    until the start returns: a stop signal meanwhile goes to another thread of the trainer, or
    waits, pending, for the end of the block; Python runs the trainer's handler either way.

    multiprocessing's resource tracker is started first: its launch blocks and then unblocks
    SIGINT and SIGTERM in the calling thread (resource_tracker.ensure_running, bpo-33613), which
    would end the block for every process spawned after it."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SPARED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


__all__ = ["EngineDeath", "EngineDied", "KEPT", "SPARED", "kept_handlers", "restore_handlers",
           "spared_from_stop_signals", "take_over_now"]
