"""megatron-core's choice of Adam in a process, switched as its imports would make it with TE or Apex:
TE's FusedAdam whenever Transformer Engine imports, Apex's when only Apex does, torch's AdamW
otherwise (megatron/core/optimizer/__init__.py; the same choice in distrib_optimizer.py). The fused
ones are the libraries' test doubles (tests/doubles/*/optimizers/fused_adam.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_TORCH_CHOICE: dict = {}  # megatron's own choice in this process (neither TE nor Apex imports here)


def use_adam(kind: str) -> None:
    """megatron's module-level choice of Adam, as its imports would make it with TE or Apex present;
    "torch" puts megatron's own choice back (a process may build models of both kinds)."""
    import megatron.core.optimizer as mo
    import megatron.core.optimizer.distrib_optimizer as do

    if not _TORCH_CHOICE:
        _TORCH_CHOICE.update(mo=(mo.Adam, mo.USING_PYTORCH_OPTIMIZER),
                             do=(do.Adam, do.HAVE_APEX_OR_TE, do.USING_TE_OPTIMIZER, do.USING_APEX_OPTIMIZER))
    if kind == "torch":
        mo.Adam, mo.USING_PYTORCH_OPTIMIZER = _TORCH_CHOICE["mo"]
        do.Adam, do.HAVE_APEX_OR_TE, do.USING_TE_OPTIMIZER, do.USING_APEX_OPTIMIZER = _TORCH_CHOICE["do"]
        return
    # The double's own file, without importing its package (which imports the whole library double
    # by its real name, as the library does: that takes the library's world, tests/helpers/worlds.py).
    doubles = Path(__file__).resolve().parents[1] / "doubles"
    path = {"te": doubles / "te/transformer_engine/pytorch/optimizers/fused_adam.py",
            "apex": doubles / "apex/apex/optimizers/fused_adam.py"}[kind]
    spec = importlib.util.spec_from_file_location(f"{kind}_fused_adam_double", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    FusedAdam = module.FusedAdam
    mo.Adam, mo.USING_PYTORCH_OPTIMIZER = FusedAdam, False
    do.Adam, do.HAVE_APEX_OR_TE = FusedAdam, True
    do.USING_TE_OPTIMIZER, do.USING_APEX_OPTIMIZER = kind == "te", kind == "apex"


__all__ = ["use_adam"]
