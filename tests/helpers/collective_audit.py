"""Test-only (tests/distributed/test_collectives.py): torch.distributed's communication calls wrapped so that
every call made directly from project code is recorded.

A call whose immediate caller is a file of vapo_megatron/ or model_providers/ other than
vapo_megatron/mcore/parallel.py bypasses the device-placing helpers (parallel.all_reduce, ...); calls
from parallel.py are counted as going through them. megatron-core's and torch's own calls are
not judged: they place their tensors themselves.

    python -m tests.helpers.collective_audit --config FILE [overrides]   (under torchrun, or as the
    entry point of tests/helpers/train_runs.py train_in_forks)
runs vapo-train with the wrappers installed; each rank writes {"bypasses": [...], "through":
{name: count}, "nccl_at_start": {NCCL_...: value}} to $VAPO_AUDIT_DIR/rank<RANK>.json when the run ends.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tuple(str(ROOT / d) + os.sep for d in ("vapo_megatron", "model_providers"))
HELPERS = str(ROOT / "vapo_megatron" / "mcore" / "parallel.py")
# Every communication call of torch.distributed that takes tensors or objects.
COMMUNICATION = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "gather", "scatter", "reduce", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "barrier", "monitored_barrier", "all_gather_object", "gather_object",
    "broadcast_object_list", "scatter_object_list",
)

bypasses: list[str] = []
through: dict[str, int] = {}
# NCCL's settings as this process had them when it started torch.distributed (mcore/nccl_env.py).
NCCL_NAMES = ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE")
nccl_at_start: dict[str, str | None] = {}


def _audited(name: str, fn):
    def call(*args, **kwargs):
        caller = sys._getframe(1)
        path = caller.f_code.co_filename
        if path == HELPERS:
            through[name] = through.get(name, 0) + 1
        elif path.startswith(PROJECT):
            bypasses.append(f"dist.{name} called from {os.path.relpath(path, ROOT)}:{caller.f_lineno} "
                            f"({caller.f_code.co_name})")
        return fn(*args, **kwargs)

    return call


_installed = False


def _init_recorded(fn):
    def init_process_group(*args, **kwargs):
        nccl_at_start.update({k: os.environ.get(k) for k in NCCL_NAMES})
        return fn(*args, **kwargs)

    return init_process_group


def install() -> None:
    """Wrap torch.distributed's communication calls (module attributes, looked up at call time by
    `dist.X(...)` in project code and megatron-core), and its init_process_group to record the
    NCCL settings before any communicator exists; once per process."""
    global _installed
    if not _installed:
        for name in COMMUNICATION:
            setattr(dist, name, _audited(name, getattr(dist, name)))
        dist.init_process_group = _init_recorded(dist.init_process_group)
        _installed = True


def record() -> dict:
    return {"bypasses": list(bypasses), "through": dict(through), "nccl_at_start": dict(nccl_at_start)}


def main(argv: list[str]) -> int:
    install()
    from vapo_megatron.train import main as train_main

    code = train_main(argv)
    out = Path(os.environ["VAPO_AUDIT_DIR"]) / f"rank{os.environ['RANK']}.json"
    out.write_text(json.dumps(record()))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
