"""Run unmodified megatron-core on the CPU (gloo) when no GPU is present.

megatron-core assumes CUDA in three places (docs/architecture.md, "Two worlds"):
  1. device placement through ``torch.cuda.current_device()`` and ``device="cuda"``;
  2. CUDA RNG state (``torch.cuda.get_rng_state`` and megatron's ``_get/_set_cuda_rng_state``),
     used by ``model_parallel_cuda_manual_seed`` and the RNG tracker's ``fork()``;
  3. literal ``device="cuda"`` tensors inside the pipeline schedules.

``activate()`` redirects these to the CPU without touching megatron-core's files:
  - a ``TorchFunctionMode`` rewrites CUDA device arguments of torch calls to ``cpu`` and makes
    ``Tensor.cuda()`` a no-op;
  - the CUDA RNG API is backed by a private CPU ``torch.Generator`` so that megatron's tracker
    works and never disturbs the default CPU generator (weights initialized on the CPU stay
    identical across TP ranks);
  - ``torch.cuda.synchronize`` and ``current_device`` become harmless;
  - ``Tensor.type()`` reports CUDA type names (megatron's grad clipping asserts
    ``grad.type() == 'torch.cuda.FloatTensor'``): under the redirection, CPU tensors are what
    megatron believes are CUDA tensors;
  - CUDA streams (megatron DDP's gradient sync waits on ``torch.cuda.current_stream()``) are
    null streams: on the CPU every op is already ordered; their events are complete at once;
  - the MoE all-to-all token dispatcher's split sizes become numpy arrays on the CPU as they do
    from CUDA tensors (gloo's all_to_all_single takes lists, not tensors).

It does nothing when CUDA is available. Only ``vapo_megatron.mcore.parallel`` calls it; no other
module knows about it.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.overrides import TorchFunctionMode

_active = False
_mode: TorchFunctionMode | None = None
# Stands in for the CUDA default generator: megatron seeds, saves and restores it.
_fake_cuda_generator = torch.Generator(device="cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal in torch's factory functions and in Tensor.to().
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites device="cuda"/ordinal arguments to "cpu"; ``Tensor.cuda()`` returns self."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else "torch.cuda." + name[len("torch."):]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs a CUDA driver
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            return _backward_in_mode(self, func, args, kwargs)
        return func(*args, **kwargs)


def _backward_in_mode(mode: TorchFunctionMode, func, args, kwargs) -> None:
    """Tensor.backward / torch.autograd.backward with `mode` active during the pass.

    A mode is off while its __torch_function__ runs, and a backward pass may run model code:
    activation recomputation re-runs whole layers, with their device="cuda" literals. Calling
    `func` again with the mode on would dispatch back here, so the arguments are normalized as
    torch.autograd.backward does and the autograd engine is called directly, as megatron's own
    pipeline schedules do (custom_backward)."""
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if func is torch.Tensor.backward:
        tensors, grads = a["self"], a["gradient"]
    else:
        tensors, grads = a["tensors"], a["grad_tensors"]
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    grads = torch.autograd._make_grads(tensors, torch.autograd._tensor_or_tensors_to_tuple(grads, len(tensors)),
                                       is_grads_batched=False)
    inputs = a["inputs"]
    if inputs is None:
        inputs = ()
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    else:
        inputs = tuple(inputs.values() if isinstance(inputs, dict) else inputs)
    retain_graph = a["create_graph"] if a["retain_graph"] is None else a["retain_graph"]
    with mode:
        torch.autograd.Variable._execution_engine.run_backward(
            tensors, grads, retain_graph, a["create_graph"], inputs, allow_unreachable=True, accumulate_grad=True,
        )


class _NullStream:
    """Stands in for torch.cuda.Stream: CPU ops run in order, so there is nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None) -> "_NullStream":
        # megatron's all-to-all token dispatcher records an event on its device-to-host stream
        # and later synchronizes on it; a null stream is its own (already complete) event.
        return self

    def wait(self, stream=None) -> None:
        pass


def _cuda_get_rng_state(device="cuda"):
    return _fake_cuda_generator.get_state()


def _cuda_set_rng_state(new_state, device=-1, graph_safe=None):
    _fake_cuda_generator.set_state(new_state)


def _cuda_manual_seed(seed):
    _fake_cuda_generator.manual_seed(int(seed))


def activate() -> bool:
    """Install the redirections once per process; returns True if they are active."""
    global _active, _mode
    if _active:
        return True
    if torch.cuda.is_available():
        return False

    torch.cuda.current_device = lambda: 0  # an ordinal, rewritten to "cpu" by the mode
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.Stream = _NullStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.get_rng_state = _cuda_get_rng_state
    torch.cuda.set_rng_state = _cuda_set_rng_state
    torch.cuda.manual_seed = _cuda_manual_seed
    torch.cuda.manual_seed_all = _cuda_manual_seed

    from megatron.core.tensor_parallel import random as mpu_random

    mpu_random._get_cuda_rng_state = lambda *a, **k: _cuda_get_rng_state()
    mpu_random._set_cuda_rng_state = lambda new_state, *a, **k: _cuda_set_rng_state(new_state)

    _moe_split_sizes_as_numpy()

    _mode = _CudaToCpuMode()
    _mode.__enter__()  # stays pushed for the life of the process (this thread)
    _active = True
    return True


def _moe_split_sizes_as_numpy() -> None:
    """megatron's all-to-all token dispatcher turns its split sizes into numpy arrays through
    moe_utils.maybe_move_tensor_to_cpu(t, as_numpy=True), which converts only CUDA tensors; on the
    CPU they stay tensors, and all_to_all_single rejects tensors as split sizes. Convert CPU
    tensors too (in token_dispatcher's namespace, which imported the function by name)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


def is_active() -> bool:
    return _active
