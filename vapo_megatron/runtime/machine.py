"""The CPU kind a process runs on: what a float result depends on besides the code and the seed.

The same seed and commit give another trajectory on another CPU kind (torch picks other kernels
for other vector units, and sums round differently), so a learning study runs on one kind and the
suite's golden records are kept per kind. Pure Python but for torch's own report
of the kernels it dispatches to.
"""

from __future__ import annotations

import platform
from pathlib import Path


def machine() -> dict[str, str]:
    """{"cpu": model name, "cpu_id": vendor/family/model, "torch_cpu_capability": e.g. AVX512}: the
    first from /proc/cpuinfo (Linux), the last torch.backends.cpu.get_cpu_capability()."""
    import torch

    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "vendor_id") and key not in info:
                info[key] = value.strip()
    except OSError:
        pass
    return {"cpu": info.get("model name") or platform.processor() or platform.machine(),
            "cpu_id": "/".join(info.get(k, "?") for k in ("vendor_id", "cpu family", "model")),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def kind_key(kind: dict[str, str]) -> str:
    """One string naming a CPU kind, for file and dictionary keys."""
    return f"{kind['cpu_id']} {kind['torch_cpu_capability']} ({kind['cpu']})"
