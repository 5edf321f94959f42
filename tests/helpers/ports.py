"""Rendezvous ports for the ranks the tests start (torchrun, spawned gloo ranks).

A port is picked here and bound later by another process. Picked from the kernel's ephemeral range
(binding port 0), it can be taken in between by any outgoing connection, and gloo's and the
stores' connections draw many: with two pytest-xdist workers starting ranks at once, a torchrun
store failed with EADDRINUSE. So ports come from just below the ephemeral range, which outgoing
connections never use, and each xdist worker draws from its own block of 1000.
"""

from __future__ import annotations

import os
import random
import socket


def free_port() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    high = ephemeral_low - 1000 * worker
    low = max(1024, high - 1000)
    candidates = list(range(low, high))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high - 1} (xdist worker {worker})")
