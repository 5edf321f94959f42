"""A small process pool whose every task has a hard wall-clock bound.

Why not math-verify's own timeout: it uses ``signal.alarm``, which only works in the main
thread and only interrupts Python bytecode, so a C-level loop (a huge integer power inside
sympy, a regex on a megabyte string) runs on regardless. Here each task runs in a worker
process; when a task passes its deadline the parent kills that worker and starts a fresh
one, so the bound holds whatever the task does.

Workers are started with the ``spawn`` method (safe in a process that already runs torch
threads or a process group) and resolve the task function from a ``"module:function"``
string, so user functions need no pickling.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine can take a while


def _import(mod_name: str):
    """The module, found as `python -m` finds one: installed, on PYTHONPATH, or in the working
    directory. A console script (vapo-train, vapo-eval) lacks the working directory on sys.path
    that `python -m` and `torchrun -m` put first; it is added last, so it never shadows a package."""
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name != mod_name.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(mod_name)


def resolve_function(spec: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function (clear errors for each way it can be wrong)."""
    if spec.count(":") != 1:
        raise ValueError(f"reward function spec {spec!r} must look like 'package.module:function'")
    mod_name, fn_name = spec.split(":")
    try:
        module = _import(mod_name)
    except ImportError as e:
        raise ValueError(f"reward function spec {spec!r}: cannot import module {mod_name!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"reward function spec {spec!r}: module {mod_name!r} has no callable {fn_name!r}")
    return fn


def _worker(conn: mpc.Connection, spec: str) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    try:
        fn = resolve_function(spec)
    except Exception as e:  # reported to the parent, which raises it with the spec named
        conn.send(("startup_error", f"{type(e).__name__}: {e}"))
        return
    # Optional warm-up hook (``fn.warmup()``): pay lazy imports/initialisation before the
    # first timed task, so a fresh worker does not spend its first deadline importing.
    warmup = getattr(fn, "warmup", None)
    if callable(warmup):
        try:
            warmup()
        except Exception as e:
            conn.send(("startup_error", f"warmup failed: {type(e).__name__}: {e}"))
            return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        task_id, args = msg
        try:
            conn.send((task_id, ("ok", fn(*args))))  # an unpicklable result raises here, before any byte is sent
        except BaseException as e:  # SystemExit, KeyboardInterrupt too: the user's function fails, not the worker
            conn.send((task_id, ("error", (type(e).__name__, _describe(e), _traceback()))))


def _describe(e: BaseException) -> str:
    """str(e), cut to 500 chars; an exception whose __str__ itself raises still gets a message."""
    try:
        return str(e)[:500]
    except BaseException:  # noqa: BLE001
        return f"<{type(e).__name__} whose message cannot be formatted>"


def _traceback() -> str:
    try:
        return traceback.format_exc(limit=5)[-5000:]
    except BaseException:  # noqa: BLE001
        return ""


@dataclass(frozen=True)
class Outcome:
    value: Any = None  # the function's return value when it finished
    timed_out: bool = False
    error_kind: str | None = None  # exception type name, or "WorkerDied"
    error: str | None = None  # message (and traceback for the first of a kind is logged by callers)
    traceback: str | None = None


class _Worker:
    def __init__(self, ctx, spec: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.t_start = time.monotonic()
        self.task: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class BoundedPool:
    """``num_workers`` processes running ``spec`` with a hard per-task bound of ``timeout_s``.

    The bound counts from the moment a ready worker receives the task. ``run`` returns one
    Outcome per argument tuple, in order.
    """

    def __init__(self, spec: str, *, num_workers: int, timeout_s: float):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.spec = spec
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx, spec) for _ in range(num_workers)]
        self._closed = False
        atexit.register(self.close)

    def _handle_startup(self, w: _Worker) -> None:
        kind, payload = w.conn.recv()
        if kind == "startup_error":
            self.close()
            raise ValueError(f"reward worker could not load {self.spec!r}: {payload}")
        w.ready = True

    def wait_ready(self, timeout_s: float = _STARTUP_TIMEOUT_S) -> None:
        """Block until every worker has started (e.g. once at trainer start-up, or in tests
        before measuring a bound). Replacement workers after a timeout start in the background."""
        end = time.monotonic() + timeout_s
        for w in self._workers:
            if w.ready:
                continue
            if not w.conn.poll(max(0.0, end - time.monotonic())):
                raise RuntimeError(f"reward worker for {self.spec!r} did not start in {timeout_s:.0f}s")
            try:
                self._handle_startup(w)
            except EOFError:
                raise RuntimeError(f"reward worker for {self.spec!r} died on start-up") from None

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._ctx, self.spec)

    def run(self, tasks: list[tuple]) -> list[Outcome]:
        if self._closed:
            raise RuntimeError("BoundedPool is closed")
        results: list[Outcome | None] = [None] * len(tasks)
        todo = list(range(len(tasks)))[::-1]  # pop() from the end gives task order
        while todo or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.task is None and todo:
                    w.task = todo.pop()
                    w.deadline = now + self.timeout_s
                    w.conn.send((w.task, tasks[w.task]))
                elif not w.ready and now - w.t_start > _STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"reward worker for {self.spec!r} did not start in {_STARTUP_TIMEOUT_S:.0f}s")
            busy = [w.deadline for w in self._workers if w.task is not None]
            wait_s = max(0.0, min(busy) - now) if busy else 1.0
            ready = mpc.wait([w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers], timeout=wait_s)
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.conn in ready:
                    try:
                        if not w.ready:
                            self._handle_startup(w)
                            continue
                        task_id, (kind, payload) = w.conn.recv()
                    except (EOFError, OSError):
                        pass  # died; the sentinel branch below handles it
                    else:
                        if kind == "ok":
                            results[task_id] = Outcome(value=payload)
                        else:
                            name, msg, tb = payload
                            results[task_id] = Outcome(error_kind=name, error=msg, traceback=tb)
                        w.task = None
                        continue
                if w.task is not None and now >= w.deadline:
                    results[w.task] = Outcome(timed_out=True)
                    w.task = None
                    self._replace(i)
                elif not w.proc.is_alive() and (w.proc.sentinel in ready or w.conn in ready):
                    if w.task is not None:
                        results[w.task] = Outcome(error_kind="WorkerDied", error=f"exit code {w.proc.exitcode}")
                        w.task = None
                    elif not w.ready:
                        raise RuntimeError(f"reward worker for {self.spec!r} died on start-up "
                                           f"(exit code {w.proc.exitcode})")
                    self._replace(i)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            w.kill()

    def __enter__(self) -> "BoundedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
