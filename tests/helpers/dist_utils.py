"""Run a function on N real ranks (gloo on the CPU) and collect each rank's return value.

The ranks are forked from a forkserver that imported torch, megatron-core and transformers once
(PRELOAD): a freshly spawned interpreter spends ~10 s of CPU importing them, the most of what a
tiny-model test costs on the 2-core CI machine. The server is single-threaded (it only imports;
no tensor op has started a thread pool), so forking it is safe, and each rank gets the caller's
environment as spawn would give it."""

from __future__ import annotations

import importlib
import os
import pickle
import queue as queue_module
import sys
import time
import traceback
from dataclasses import dataclass

import torch.multiprocessing as mp

from tests.helpers.ports import free_port

# Imported once by the forkserver; every rank forked from it starts with them loaded.
# tests.helpers.preload first: megatron-core imported as the commands import it (import_megatron).
PRELOAD = ["tests.helpers.preload", "torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
           "transformers", "vapo_megatron.mcore.models", "vapo_megatron.mcore.parallel", "vapo_megatron.mcore.schedule"]


def _worker(rank, world_size, port, fn, args, queue, env):
    os.environ.clear()
    os.environ.update(env)  # the caller's, as a spawned process would inherit it
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    try:
        result = fn(*args)
        # Plain pickle bytes (our own child's data): tensors are copied, not passed as
        # shared-memory handles that vanish when this process exits.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report the traceback to the parent, which fails the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        from vapo_megatron.mcore import parallel

        parallel.destroy()


def start_forkserver() -> None:
    """The forkserver, preloaded (PRELOAD), started now if it is not running: a caller that counts
    this process's children (tests/helpers/train_runs.py) finds it among them before its ranks start."""
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # takes effect when the server starts
    forkserver.ensure_running()


@dataclass
class Ended:
    """How the ranks of one end_ranks call ended."""

    results: dict[int, object]  # rank -> fn's return value
    failures: dict[int, str]  # rank -> why it gave none: its traceback, its death, or no end in time
    exitcodes: list[int | None]  # each process's own (-N: signal N); None: killed here, not ended by itself
    raised: set[int]  # the ranks whose fn raised (their failure: "rank R:\n" and the traceback)


def end_ranks(world_size: int, fn, *args, timeout: float = 600.0, grace: float = 5.0) -> Ended:
    """fn(*args) on `world_size` forked processes, each until it returns, raises or dies. Once one
    has failed, the others have `grace` seconds to end by themselves (a whole-job kill: each rank
    reaches its own fault point), and are then killed, as torchrun ends a job's other workers."""
    start_forkserver()
    ctx = mp.get_context("forkserver")
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, failures = {}, {}
    deadline = time.monotonic() + timeout
    while len(results) + len(failures) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=2.0)
        except queue_module.Empty:
            # A rank's result is in the pipe before its process ends (a Queue's feeder thread is
            # flushed at exit), so a rank that has ended and sent nothing within 2 s never will.
            for r, p in enumerate(procs):
                if p.exitcode is not None and r not in results and r not in failures:
                    failures[r] = f"rank {r} ended with exit code {p.exitcode} and no result"
                    deadline = min(deadline, time.monotonic() + grace)
            continue
        if status == "ok":
            results[rank] = pickle.loads(value)
        else:
            failures[rank] = f"rank {rank}:\n{value}"
            deadline = min(deadline, time.monotonic() + grace)
    if not failures and len(results) < world_size:  # the time ran out
        failures.update({r: f"rank {r}: no result within {timeout:.0f} s" for r in range(world_size)
                         if r not in results})
    killed = set()
    for r, p in enumerate(procs):
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            killed.add(r)
            if r not in results:
                failures.setdefault(r, f"rank {r} had not ended {grace:.0f} s after another rank failed: killed")
    raised = {r for r, why in failures.items() if why.startswith(f"rank {r}:\n")}
    return Ended(results, failures, [None if r in killed else p.exitcode for r, p in enumerate(procs)], raised)


def run_ranks(world_size: int, fn, *args, timeout: float = 600.0) -> list:
    """fn(*args) on `world_size` forked processes; returns [result of rank 0, rank 1, ...]. A rank that
    raises, or dies without a result (a signal, os._exit), fails the call with what it knows
    (end_ranks: the rest are killed, as torchrun ends a job's other workers)."""
    ended = end_ranks(world_size, fn, *args, timeout=timeout)
    if ended.failures:
        raise AssertionError("\n".join(ended.failures.values()))
    return [ended.results[r] for r in range(world_size)]


def command_main(module: str, argv: list[str], out_dir: str) -> int:
    """A command's main(argv) in this forked rank, as its process would end: the exit code (a
    SystemExit's, 1 when it carries no number); the rank's stdout and stderr go to
    out_dir/rank{RANK}.{out,err}, RANK 0 where no launcher set one."""
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(f"{out_dir}/rank{os.environ.get('RANK', '0')}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    try:
        return importlib.import_module(module).main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
