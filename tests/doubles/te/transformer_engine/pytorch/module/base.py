"""Test double of transformer_engine/pytorch/module/base.py (TE 2.20): the base of TE's layers.

What megatron-core and this project depend on, as base.py has it:
- `_extra_state` (get_extra_state, ~line 1354): every TE module's state_dict() holds
  `<prefix>._extra_state`, an EMPTY uint8 tensor when FP8 is off (TE pickles FP8 scales into it
  otherwise); set_extra_state (~1419) ignores None and empty tensors. A non-empty one carries FP8
  metadata, which is not modelled here: it raises NotImplementedError.
- parameters are registered with an init function and an RNG tracker (register_parameter, ~1791)
  and initialized by reset_parameters (~1804): each one re-wrapped in a fresh Parameter after
  `init_fn(param)` ran under `get_rng_state_tracker().fork(rng_tracker_name)` (or `.fork()`), or
  directly without a tracker; nothing is initialized when the device is "meta" (defer_init).
- the forward checks (prepare_forward, ~1587): a TP size above 1 needs a TP group, and outside
  autocast the input dtype must equal every parameter's dtype (TypeError otherwise).
- get_dummy_wgrad (~134): one cached buffer per (shape, dtype), zeroed on request.
TE's other duties (FP8 metadata, userbuffers, debug hooks, FSDP) are not modelled.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from transformer_engine.pytorch.extra_state import check_extra_state, empty_extra_state

_dummy_wgrads: dict = {}


def get_dummy_wgrad(shape: list, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    key = (*shape, dtype)
    if key not in _dummy_wgrads:
        _dummy_wgrads[key] = torch.empty(shape, dtype=dtype, device="cuda", requires_grad=False)
    if zero:
        _dummy_wgrads[key].fill_(0)
    return _dummy_wgrads[key].detach()


def init_method_constant(val: float) -> Callable:
    """utils.py `init_method_constant`."""
    def init_(tensor: torch.Tensor):
        return torch.nn.init.constant_(tensor, val)
    return init_


def get_default_init_method() -> Callable:
    """utils.py `get_default_init_method`: normal, std 0.023."""
    return lambda tensor: torch.nn.init.normal_(tensor, mean=0.0, std=0.023)


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """distributed.py `set_tensor_model_parallel_attributes` (refuses a tensor that has them)."""
    for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(tensor, attribute):
            raise RuntimeError(f"Tensor already has attribute '{attribute}' set. Cannot set "
                               "tensor model parallel attributes on a tensor that already has them.")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def distributed_world_size(group) -> int:
    """distributed.py `get_distributed_world_size`: 1 without torch.distributed."""
    if not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


def refuse_unmodelled(module: str, **options) -> None:
    """NotImplementedError naming the options that are on (FP8, userbuffers, delayed wgrad, ...)."""
    on = sorted(k for k, v in options.items() if v)
    if on:
        raise NotImplementedError(f"test double: {module} with {on} is not modelled")


class TransformerEngineBaseModule(torch.nn.Module):
    def __init__(self, name: Optional[str] = None) -> None:
        super().__init__()
        self.name = name
        self.fp8_initialized = False
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False, "fp8_group": None}
        self.quantizers = {"scaling_fwd": [], "scaling_bwd": []}
        self.tp_group = None
        self.tp_size = 1
        self.sequence_parallel = False
        self.param_init_meta = {}
        self.primary_weights_in_fp8 = False
        self.activation_dtype: Optional[torch.dtype] = None

    def fast_setattr(self, name: str, value) -> None:
        self.__dict__[name] = value

    def module_setattr(self, name: str, value) -> None:
        super().__setattr__(name, value)

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.fast_setattr("tp_group", tp_group)
        self.fast_setattr("tp_group_initialized", True)

    def set_nccl_overlap_warning_if_tp(self) -> None:
        pass

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        pass  # FP8 is off: nothing to initialize (base.py init_fp8_metadata with fp8 False)

    def register_parameter(self, name, param, init_fn=None, get_rng_state_tracker=None, fp8_meta_index=None):
        super().register_parameter(name, param)
        if hasattr(self, "param_init_meta") and name not in self.param_init_meta:
            self.param_init_meta[name] = (init_fn, get_rng_state_tracker)

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        if defer_init:
            return
        for name, param in self.named_parameters(recurse=False):
            if param.device == torch.device("meta"):
                param = torch.empty_like(param, device="cuda")
            init_fn, tracker = self.param_init_meta[name]
            if tracker is None:
                init_fn(param)
            else:
                rng_name = getattr(self, "rng_tracker_name", None)
                with (tracker().fork(rng_name) if rng_name else tracker().fork()):
                    init_fn(param)
            self.module_setattr(name, torch.nn.Parameter(param))

    def get_extra_state(self) -> torch.Tensor:
        return empty_extra_state()

    def set_extra_state(self, state) -> None:
        check_extra_state(state, type(self).__name__)

    def prepare_forward(self, inp: torch.Tensor, allow_different_data_and_param_types: bool = False) -> torch.Tensor:
        if self.tp_size > 1 and not getattr(self, "tp_group_initialized", False):
            raise RuntimeError("Tensor parallel group not initialized. Call set_tensor_parallel_group() before "
                               "forward pass when tp_size > 1.")
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else inp.dtype
        if not torch.is_autocast_enabled() and not allow_different_data_and_param_types:
            for name, param in self.named_parameters():
                if param is not None and dtype != param.dtype:
                    raise TypeError("Data types for parameters must match when outside of autocasted region. "
                                    f"Found input dtype: {dtype} and {name!r} dtype: {param.dtype}")
        self.fast_setattr("activation_dtype", dtype)
        return inp.contiguous()

    def backward_dw(self):
        raise NotImplementedError("test double: delay_wgrad_compute is not modelled")


__all__ = ["TransformerEngineBaseModule", "distributed_world_size",
           "get_default_init_method", "get_dummy_wgrad", "init_method_constant",
           "refuse_unmodelled", "set_tensor_model_parallel_attributes"]
