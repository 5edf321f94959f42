"""What trainer.deterministic needs of the process environment, set before CUDA initialises.

torch.use_deterministic_algorithms(True) (trainer/trainer.py) raises at the first cuBLAS GEMM
unless CUBLAS_WORKSPACE_CONFIG is one of cuBLAS's deterministic workspace settings, which cuBLAS
reads when its first handle is created; Transformer Engine's fused attention picks a
deterministic backward only with NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (and megatron's
TEDotProductAttention refuses deterministic_mode without it; mcore/models.py passes
deterministic_mode). vapo-train calls determinism_env before it imports torch; the Trainer calls
it again (idempotent) for callers that build one directly. Pure Python: no torch here.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# The values torch accepts as deterministic (its checkCuBLASConfigDeterministic); the first is set.
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def determinism_env(deterministic: bool, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """With `deterministic`, set in `environ` (default: os.environ) what determinism needs and
    return what was changed; without it, change nothing. A deterministic CUBLAS_WORKSPACE_CONFIG
    already there is kept."""
    env = os.environ if environ is None else environ
    if not deterministic:
        return {}
    changed = {}
    if env.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_DETERMINISTIC:
        changed["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
    if env.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") != "0":
        changed["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    env.update(changed)
    return changed


__all__ = ["CUBLAS_DETERMINISTIC", "determinism_env"]
