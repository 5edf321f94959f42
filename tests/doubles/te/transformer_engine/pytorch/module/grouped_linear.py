"""Test double of transformer_engine/pytorch/module/grouped_linear.py `GroupedLinear` (TE 2.20,
class at ~1533): the grouped GEMM behind megatron's TEGroupedMLP (one GEMM per local expert).

As TE has it:
- `num_gemms` weights `weight0` ... `weight{n-1}`, each [out, in] after the TP split of
  parallel_mode, registered in that order with `bias{i}` after each `weight{i}` when bias=True
  (else `bias{i}` is an empty plain tensor); initialized like Linear's (~1740);
- bias with a TP size above 1 is refused (ValueError: "TP communication is handled outside");
- reset_parameters marks every weight tensor-parallel on dim 1 (row) or 0 (~1940);
- forward(inp, m_splits): m_splits a list or tensor of num_gemms row counts (ValueError
  otherwise, ~2195); the rows of inp are split by it and row block i goes through GEMM i; no
  communication (megatron passes no TP group: its token dispatcher moves the tokens);
- state_dict: weight0.., [bias0..], _extra_state (one for the module);
- each GEMM's backward, fuse_wgrad_accumulation included (each weight{i}'s main_grad), as Linear's
  (lines 1152-1157, 1203-1246: module/linear.py _Gemm here).
Not modelled: single grouped weight/bias tensors, TP communication inside the module, FP8,
delay_wgrad_compute, preallocated output buffers.
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_engine.pytorch.module.base import (TransformerEngineBaseModule, get_default_init_method,
                                                     init_method_constant, refuse_unmodelled)
from transformer_engine.pytorch.module.linear import gemm, mark_tp, setup_tp


class GroupedLinear(TransformerEngineBaseModule):
    def __init__(self, num_gemms: int, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 rng_tracker_name: Optional[str] = None, init_method=None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None, device="cuda",
                 ub_overlap_rs: bool = False, ub_overlap_ag: bool = False, ub_name: Optional[str] = None,
                 delay_wgrad_compute: bool = False, save_original_input: bool = False,
                 single_grouped_weight: bool = False, single_grouped_bias: bool = False, name: Optional[str] = None,
                 use_grouped_tensor: Optional[bool] = None) -> None:
        super().__init__(name)
        if ub_overlap_rs or ub_overlap_ag:
            raise ValueError("GroupedLinear doesn't support Userbuffer overlap.")
        refuse_unmodelled("GroupedLinear", delay_wgrad_compute=delay_wgrad_compute,
                          single_grouped_weight=single_grouped_weight,
                          single_grouped_bias=single_grouped_bias, use_grouped_tensor=bool(use_grouped_tensor))
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.save_original_input = save_original_input
        self.single_grouped_weight = self.single_grouped_bias = False
        self.init_method = init_method
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        if tp_group is None:
            tp = tp_size
        else:
            tp = torch.distributed.get_world_size(tp_group) if torch.distributed.is_initialized() else 1
        if tp > 1 and bias:
            raise ValueError("GroupedLinear doesn't support bias when TP > 1. "
                             "Because the TP communication is handled outside of this module.")
        setup_tp(self, tp_group, tp_size, parallel_mode, sequence_parallel)
        refuse_unmodelled("GroupedLinear", tp_communication=self.tp_size > 1)
        init = init_method or get_default_init_method()
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(
                torch.empty(self.out_features, self.in_features, device=device, dtype=self.params_dtype)),
                init_fn=init, get_rng_state_tracker=get_rng_state_tracker)
            if self.use_bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(
                    torch.empty(self.out_features, device=device, dtype=self.params_dtype)),
                    init_fn=init_method_constant(0.0))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=self.params_dtype, device=device))
        self.reset_parameters(defer_init=torch.device(device).type == "meta")

    def reset_parameters(self, defer_init=False):
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            n = range(self.num_gemms)
            mark_tp(self, [f"weight{i}" for i in n], [f"bias{i}" for i in n])

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None,
                out: Optional[torch.Tensor] = None, dgrad_out: Optional[torch.Tensor] = None):
        refuse_unmodelled("GroupedLinear.forward", out=out is not None, dgrad_out=dgrad_out is not None)
        if not isinstance(m_splits, torch.Tensor):
            m_splits = torch.tensor(m_splits, dtype=torch.int64, device="cpu")
        if tuple(m_splits.size()) != (self.num_gemms,):
            raise ValueError(f"Shape of splits tensor ({tuple(m_splits.size())}) does not match number of GEMMs "
                             f"({self.num_gemms}).")
        inp = self.prepare_forward(inp)
        rows = inp.reshape(-1, self.in_features).split(m_splits.tolist())
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        outs = [gemm(self, x, getattr(self, f"weight{i}"), biases[i] if self.apply_bias else None, is_first_microbatch)
                for i, x in enumerate(rows)]
        result = torch.cat(outs).view(*inp.shape[:-1], self.out_features)
        return (result, biases) if self.return_bias else result


__all__ = ["GroupedLinear"]
