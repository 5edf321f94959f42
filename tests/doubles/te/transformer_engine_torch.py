"""Test double of `transformer_engine_torch`, TE's compiled extension (csrc/extensions/pybind.cpp).

megatron-core imports it next to `transformer_engine` (megatron/core/utils.py) and calls it only on
paths this world does not model (THD packing, FP8 casts, GTP). Every name raises
NotImplementedError when used, so such a path fails loudly."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def unmodelled(*args, **kwargs):
        raise NotImplementedError(f"test double: transformer_engine_torch.{name} is not modelled")

    return unmodelled
