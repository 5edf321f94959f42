"""Stand-ins for TE entry points this world does not model (FP8, fused MoE kernels, fused cross
entropy, userbuffers): they exist, as in TE, so megatron-core takes the same import branches, and
raise NotImplementedError when called, so a path that needs them fails loudly."""

from __future__ import annotations


def unmodelled(name: str):
    """A function named `name` that raises NotImplementedError."""

    def stub(*args, **kwargs):
        raise NotImplementedError(f"test double: transformer_engine.pytorch {name} is not modelled")

    stub.__name__ = stub.__qualname__ = name.rsplit(".", 1)[-1]
    return stub


class UnmodelledModule:
    """A TE class that cannot be built here."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"test double: transformer_engine.pytorch {type(self).__name__} is not modelled")


__all__ = ["UnmodelledModule", "unmodelled"]
