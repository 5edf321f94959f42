"""The NCCL settings every rank of a run shares, set in one place before its process group exists.

A colocated sglang.Engine sets NCCL_CUMEM_ENABLE=0 and NCCL_NVLS_ENABLE=0 in the process that
starts it, each only where the variable is unset (sglang/srt/entrypoints/engine.py,
_set_envs_and_config, for the ServerArgs of rollout/sglang_engine.py's engine_kwargs): that is one
trainer rank per engine, the owner. NCCL reads these variables once per process, when it creates
its first communicator, so without this module the owners' communicators and their peers' could
run with different settings, decided by whether the engine started before or after NCCL's first
communicator in each process. parallel.init_distributed calls nccl_env on every rank, GPU or CPU,
before torch.distributed starts: every rank, and the engine's own processes (they inherit the
owner's environment, which SGLang then leaves as it is), run with the same values. A value the job
sets itself (e.g. NCCL_NVLS_ENABLE=1) is kept, on every rank alike, as SGLang keeps it. Pure Python.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# SGLang's values for our engines: cuMem-backed NCCL buffers and NVLink SHARP (NVLS) off.
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


def nccl_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set NCCL_ENV's values in `environ` (default: os.environ) where they are unset; return what
    was set. Idempotent."""
    env = os.environ if environ is None else environ
    changed = {k: v for k, v in NCCL_ENV.items() if k not in env}
    env.update(changed)
    return changed


__all__ = ["NCCL_ENV", "nccl_env"]
