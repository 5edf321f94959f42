"""Run a function on N real ranks (gloo on the CPU) and collect each rank's return value.

The ranks are forked from a forkserver that imported torch, megatron-core and transformers once
(PRELOAD): a freshly spawned interpreter spends ~10 s of CPU importing them, the most of what a
tiny-model test costs on the 2-core CI machine. The server is single-threaded (it only imports;
no tensor op has started a thread pool), so forking it is safe, and each rank gets the caller's
environment as spawn would give it."""

from __future__ import annotations

import os
import pickle
import traceback

import torch.multiprocessing as mp

from tests.helpers.ports import free_port


# Imported once by the forkserver; every rank forked from it starts with them loaded.
# tests.helpers.preload first: megatron-core imported as the commands import it (import_megatron).
PRELOAD = ["tests.helpers.preload", "torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "transformers",
           "vapo_megatron.mcore.models", "vapo_megatron.mcore.parallel", "vapo_megatron.mcore.schedule"]


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


def run_ranks(world_size: int, fn, *args, timeout: float = 600.0) -> list:
    """fn(*args) on `world_size` spawned processes; returns [result of rank 0, rank 1, ...]."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first call)
    queue = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    for _ in range(world_size):
        rank, status, value = queue.get()
        if status == "ok":
            results[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank}:\n{value}")
            break
    for p in procs:
        p.join(timeout=timeout if not errors else 5)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
