"""Test double of transformer_engine/pytorch/module/linear.py `Linear` (TE 2.20, class at ~1474).

As TE has it:
- parallel_mode "column" splits out_features by the TP size, "row" in_features (~1620);
  sequence parallelism is on only with TP > 1 (~1625);
- parameters `weight` [out, in] and, with bias=True, `bias` [out], in params_dtype (default: torch's
  default dtype) on `device` (default "cuda"); without a bias `bias` is an empty plain tensor, not
  a parameter (~1790); weight initialized by init_method (default normal std 0.023) under the RNG
  tracker, bias to zero; on "meta" nothing is initialized;
- reset_parameters (~1830) marks the weight tensor-parallel on dim 1 (row) or 0 (column, and also
  without a parallel mode), the column bias tensor-parallel on dim 0, the row bias with
  `sequence_parallel`;
- forward: column parallel gathers the sequence under SP (else all-reduces dgrad), row parallel
  reduces the partial products (reduce-scatter under SP) and adds its bias after the reduction;
  return_bias returns (out, bias) without adding it;
- state_dict: weight, bias, _extra_state (base.py);
- the GEMM's backward (_Gemm below, TE's _Linear): dgrad = dy W, the bias gradient summed over
  tokens, wgrad = dy^T x; with fuse_wgrad_accumulation the wgrad goes into `weight.main_grad`
  (megatron's gradient buffer) as TE's wgrad GEMM writes it (see _Gemm).
Not modelled (NotImplementedError): parameters_split, userbuffers overlap, delay_wgrad_compute,
symmetric all-reduce, FP8 outputs.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from transformer_engine.pytorch.comm import column_input, row_output
from transformer_engine.pytorch.module.base import (TransformerEngineBaseModule, distributed_world_size,
                                                     get_default_init_method, get_dummy_wgrad, init_method_constant,
                                                     refuse_unmodelled, set_tensor_model_parallel_attributes)

GEMM_PARALLEL_MODES = ("row", "column", None)


def divide(n: int, d: int) -> int:
    if n % d:
        raise AssertionError(f"{n} is not divisible by {d}")
    return n // d


def setup_tp(module, tp_group, tp_size: int, parallel_mode, sequence_parallel: bool) -> None:
    """The TP bookkeeping Linear, LayerNormLinear and GroupedLinear share (linear.py ~1600-1625)."""
    if tp_group is None:
        module.tp_size = tp_size
        if tp_size == 1:
            module.set_tensor_parallel_group(tp_group)
    else:
        module.tp_size = distributed_world_size(tp_group)
        module.set_tensor_parallel_group(tp_group)
    module.parallel_mode = parallel_mode
    assert parallel_mode in GEMM_PARALLEL_MODES, f"parallel_mode {parallel_mode} not supported"
    if parallel_mode == "column":
        module.out_features = divide(module.out_features, module.tp_size)
    elif parallel_mode == "row":
        module.in_features = divide(module.in_features, module.tp_size)
    module.sequence_parallel = module.tp_size > 1 and sequence_parallel


def add_weight_and_bias(module, *, device, params_dtype, init_method, get_rng_state_tracker, weight="weight",
                        bias="bias") -> None:
    module.register_parameter(weight, torch.nn.Parameter(
        torch.empty(module.out_features, module.in_features, device=device, dtype=params_dtype)),
        init_fn=init_method, get_rng_state_tracker=get_rng_state_tracker)
    if module.use_bias:
        module.register_parameter(bias, torch.nn.Parameter(torch.empty(module.out_features, device=device,
                                                                       dtype=params_dtype)),
                                  init_fn=init_method_constant(0.0))
    else:
        setattr(module, bias, torch.Tensor().to(dtype=params_dtype, device=device))


def mark_tp(module, weights: list[str], biases: list[str]) -> None:
    """linear.py reset_parameters: the tensor-parallel attributes megatron's DDP and clip read."""
    for w in weights:
        set_tensor_model_parallel_attributes(getattr(module, w), True, 1 if module.parallel_mode == "row" else 0, 1)
    if module.use_bias:
        for b in biases:
            if module.parallel_mode == "row":
                getattr(module, b).sequence_parallel = module.sequence_parallel
            elif module.parallel_mode == "column":
                set_tensor_model_parallel_attributes(getattr(module, b), True, 0, 1)


class _Gemm(torch.autograd.Function):
    """out = x weight^T (+ bias), with the backward of TE's linear layers. Source: NVIDIA/
    TransformerEngine transformer_engine/pytorch/module/linear.py (main d0067d0; release_v2.19 the
    same lines): _linear_setup_ctx 747-757 (with fuse_wgrad_accumulation, a weak reference to the
    weight and its `overwrite_main_grad`), _linear_backward 834-847 (main_grad read from the weight
    at backward time), 1226-1266 (the wgrad GEMM dy^T x, "NT": into `out=main_grad` in main_grad's
    dtype, accumulating unless it is the first micro-batch (is_first_microbatch True) or the weight
    overwrites main_grad), 1354-1376 (for megatron's DDP, a weight with `grad_added_to_main_grad`
    gets it set and a dummy wgrad is returned, zeroed with `zero_out_wgrad`; without the attribute,
    None); layernorm_linear.py 1012-1040, 1169-1183 and grouped_linear.py 1152-1157, 1203-1246 do the
    same per weight. Unfused, the wgrad (in the activation dtype) is returned, and megatron's DDP hook
    adds it to main_grad. Both paths compute dy^T x with the same expression, so in float32 the fused
    gradient is bitwise the unfused one (TE's kernel adds inside the GEMM: its rounding may differ)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fuse: bool, is_first_microbatch):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.fuse = fuse and weight.requires_grad
        ctx.is_first_microbatch = is_first_microbatch
        if ctx.fuse:
            ctx.origin_weight = weakref.ref(weight)
            ctx.overwrites_main_grad = getattr(weight, "overwrite_main_grad", False)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2d, x2d = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dgrad = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dbias = dy2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        wgrad = None
        if ctx.needs_input_grad[1]:
            if not ctx.fuse:
                wgrad = dy2d.t().matmul(x2d)
            else:
                origin = ctx.origin_weight()
                assert origin is not None, "weight was removed while fuse_wgrad_accumulation=True"
                main_grad = origin.main_grad
                accumulate = ctx.is_first_microbatch is None or not ctx.is_first_microbatch
                product = dy2d.t().to(main_grad.dtype).matmul(x2d.to(main_grad.dtype))
                with torch.no_grad():
                    if accumulate and not ctx.overwrites_main_grad:
                        main_grad.add_(product)
                    else:
                        main_grad.copy_(product)
                if hasattr(origin, "grad_added_to_main_grad"):
                    origin.grad_added_to_main_grad = True
                    wgrad = get_dummy_wgrad(list(origin.shape), origin.dtype,
                                            zero=getattr(origin, "zero_out_wgrad", False))
        return dgrad, wgrad, dbias, None, None


def gemm(module, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
         is_first_microbatch: Optional[bool]) -> torch.Tensor:
    """x @ weight.T (+ bias) through _Gemm, with the module's fuse_wgrad_accumulation."""
    return _Gemm.apply(x, weight, bias, module.fuse_wgrad_accumulation, is_first_microbatch)


def parallel_gemm(module, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
    """x @ weight.T with TE's TP communication around it; the bias added unless return_bias."""
    apply_bias = module.apply_bias
    if module.parallel_mode == "column":
        x = column_input(x, module.tp_group, module.sequence_parallel)
    fused_bias = bias if apply_bias and module.parallel_mode != "row" else None
    out = gemm(module, x, weight, fused_bias, is_first_microbatch)
    if module.parallel_mode == "row":
        out = row_output(out, module.tp_group, module.sequence_parallel)
        if apply_bias:
            out = out + bias
    return out


class Linear(TransformerEngineBaseModule):
    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 rng_tracker_name: Optional[str] = None, init_method=None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 parameters_split=None, device="cuda", ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False, symmetric_ar_type=None,
                 save_original_input: bool = False, name: Optional[str] = None) -> None:
        super().__init__(name)
        refuse_unmodelled("Linear", parameters_split=parameters_split is not None, ub_overlap_ag=ub_overlap_ag,
                          ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
                          ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
                          delay_wgrad_compute=delay_wgrad_compute, symmetric_ar_type=symmetric_ar_type is not None)
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.save_original_input = save_original_input
        setup_tp(self, tp_group, tp_size, parallel_mode, sequence_parallel)
        add_weight_and_bias(self, device=device, params_dtype=params_dtype,
                            init_method=init_method or get_default_init_method(),
                            get_rng_state_tracker=get_rng_state_tracker)
        self.reset_parameters(defer_init=torch.device(device).type == "meta")

    def reset_parameters(self, defer_init=False):
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            mark_tp(self, ["weight"], ["bias"])

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        refuse_unmodelled("Linear.forward", fp8_output=fp8_output, fp8_grad=fp8_grad)
        inp = self.prepare_forward(inp)
        out = parallel_gemm(self, inp, self.weight, self.bias, is_first_microbatch)
        return (out, self.bias) if self.return_bias else out


__all__ = ["Linear", "add_weight_and_bias", "divide", "gemm", "mark_tp", "parallel_gemm", "setup_tp"]
