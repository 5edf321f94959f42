"""Import megatron-core without compiling anything at import time where no GPU is visible.

megatron-core 0.19.2 sets `jit_fuser = torch.compile` (megatron/core/jit.py) and decorates its
fused kernels with it as its modules load (fusions/fused_bias_geglu.py, fused_bias_swiglu.py,
fused_bias_dropout.py, ...). Each torch.compile call imports torch._dynamo and torch._inductor:
about 5 s of CPU in every process that imports megatron-core, a third of a rank's start-up on
the CPU. Without CUDA the trainer never calls those kernels (models.py, `compiled_fusions`: the
bias fusions are off, the same math unfused), and the CPU runs megatron's local layers, so the
decoration buys nothing there. `import_megatron()` imports megatron-core with torch.compile
standing in as the identity while megatron's modules are decorated, then makes megatron's own
`disable_jit_fuser()` call for the modules it loads later (MoE, dist checkpointing); torch.compile
itself is restored at once. torch.compile's contract is that it does not change results, so an
eager kernel computes what the compiled one would.

With CUDA it only imports megatron-core: the GPU path keeps megatron's compiled fusions.

On any machine, megatron/core/timers.py imports wandb at its import when wandb is installed (for
its timers' wandb writer, which the trainer never uses: its own wandb run is trainer/wandb_run.py,
imported when trainer.wandb is on). That import is about 1 s of CPU in every process. So wandb
is hidden while megatron-core loads (timers.py then binds wandb = None, its own fallback) and
importable again right after; a wandb imported before is left alone.
Called first by every command that builds a model (config/quiet.py `device_startup`, vapo-plan)
and by the test suite's forkserver; a module imported before it that imports megatron-core
gets the compiled decoration, which is only slower to import. benchmarks/startup.py measures
the difference.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch


def _identity_compile(model=None, **_options):
    """torch.compile's signature, as a decorator with or without arguments, returning the function."""
    return model if model is not None else (lambda fn: fn)


@contextmanager
def _hidden(name: str):
    """`import name` raises ImportError inside the block (None in sys.modules), unless it is imported already."""
    hide = name not in sys.modules
    if hide:
        sys.modules[name] = None
    try:
        yield
    finally:
        if hide and sys.modules.get(name, 0) is None:
            del sys.modules[name]


def import_megatron() -> bool:
    """Import megatron.core, wandb hidden meanwhile; without CUDA, with its jit_fuser the identity.
    Returns whether the fusions were left eager (False: CUDA is visible, or megatron-core was
    imported already)."""
    if "megatron.core" in sys.modules:
        return False
    eager = not torch.cuda.is_available()
    real = torch.compile
    if eager:
        torch.compile = _identity_compile  # what megatron/core/jit.py binds jit_fuser to at its import
    try:
        with _hidden("wandb"):
            import megatron.core  # noqa: F401
    finally:
        torch.compile = real
    if not eager:
        return False
    from megatron.core import jit

    jit.disable_jit_fuser()  # its no-op decorator, for megatron modules imported from now on
    return True


__all__ = ["import_megatron"]
