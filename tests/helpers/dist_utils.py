"""Run a function on N real ranks (gloo on the CPU) and collect each rank's return value."""

from __future__ import annotations

import os
import pickle
import traceback

import torch.multiprocessing as mp

from tests.helpers.ports import free_port


def _worker(rank, world_size, port, fn, args, queue):
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
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
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
