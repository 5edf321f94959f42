"""Test double of transformer_engine/pytorch/quantization.py: the global FP8 state and its context
managers (megatron-core imports them through the deprecated alias fp8.py).

FP8 is never on in this world: FP8GlobalStateManager reports it off (quantization.py
`is_fp8_enabled`, `with_fp8_parameters`, ...: False), and the context managers are plain contexts
when `enabled=False` (megatron opens fp8_autocast(enabled=False) to force BF16) and raise
NotImplementedError when asked to turn FP8 on."""

from __future__ import annotations

from contextlib import contextmanager

from transformer_engine.common import recipe  # noqa: F401 - as TE, importing the quantization API loads the recipes


def _refuse(what: str):
    raise NotImplementedError(f"test double: {what} with FP8/FP4 on is not modelled")


class FP8GlobalStateManager:
    """quantization.py `FP8GlobalStateManager`: the process-wide quantization state, always off here."""

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return False

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return False

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return False

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return False

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return False

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        return False

    @classmethod
    def get_fp8_recipe(cls):
        _refuse("FP8GlobalStateManager.get_fp8_recipe")

    @classmethod
    def get_fp8_group(cls):
        return None

    @classmethod
    def reduce_and_update_fp8_tensors(cls, *args, **kwargs):
        _refuse("FP8GlobalStateManager.reduce_and_update_fp8_tensors")

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, *args, **kwargs):
        _refuse("FP8GlobalStateManager.add_fp8_tensors_to_global_buffer")

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip) -> None:
        _refuse("FP8GlobalStateManager.set_skip_fp8_weight_update_tensor")


@contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe=None, amax_reduction_group=None, _graph=False):
    """quantization.py `autocast`: with enabled=False (and no calibration) nothing is quantized."""
    if enabled or calibrating:
        _refuse("autocast")
    yield


@contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None, _graph=False):
    """quantization.py `fp8_autocast` (deprecated name of autocast)."""
    with autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group):
        yield


@contextmanager
def quantized_model_init(enabled: bool = True, recipe=None, preserve_high_precision_init_val: bool = False):
    """quantization.py `quantized_model_init`: enabled=False builds high-precision parameters."""
    if enabled:
        _refuse("quantized_model_init")
    yield


@contextmanager
def fp8_model_init(enabled: bool = True, recipe=None, preserve_high_precision_init_val: bool = False):
    """quantization.py `fp8_model_init` (deprecated name of quantized_model_init)."""
    with quantized_model_init(enabled=enabled, recipe=recipe,
                              preserve_high_precision_init_val=preserve_high_precision_init_val):
        yield


__all__ = ["FP8GlobalStateManager", "autocast", "fp8_autocast", "fp8_model_init", "quantized_model_init"]
