"""Test double of transformer_engine/pytorch/module/layernorm_linear.py `LayerNormLinear` (TE 2.20,
class at ~1207): a norm fused into the following linear (megatron's TELayerNormColumnParallelLinear,
the TE spec's linear_qkv and dense linear_fc1).

As TE has it (besides what Linear does, module/linear.py here):
- normalization "LayerNorm" or "RMSNorm" (asserted); parallel_mode "row" is refused
  (NotImplementedError, "Normalization does not support tensor-parallel distribution.");
- parameters in this order: `layer_norm_weight` [in] (1, or 0 with zero_centered_gamma),
  `layer_norm_bias` [in] (LayerNorm only, 0; None for RMSNorm), `weight`, `bias`;
  reset_parameters marks layer_norm_weight/bias with `sequence_parallel` (~1650);
- forward: the norm on this rank's tokens, then (column parallel) the sequence gathered under SP
  and the GEMM; the norm's output is not returned (return_layernorm_output is not modelled);
- the GEMM's backward, fuse_wgrad_accumulation included, as Linear's (lines 1012-1040, 1169-1183:
  module/linear.py _Gemm here); the norm's gradients are returned as usual;
- state_dict: layer_norm_weight, [layer_norm_bias], weight, [bias], _extra_state.
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_engine.pytorch.module.base import (TransformerEngineBaseModule, get_default_init_method,
                                                     init_method_constant, refuse_unmodelled)
from transformer_engine.pytorch.module.linear import add_weight_and_bias, mark_tp, parallel_gemm, setup_tp
from transformer_engine.pytorch.ops import normalize


class LayerNormLinear(TransformerEngineBaseModule):
    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 init_method=None, bias: bool = True, normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 return_layernorm_output: bool = False, return_layernorm_output_gathered: bool = False,
                 parameters_split=None, zero_centered_gamma: bool = False, device="cuda", ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type=None, name: Optional[str] = None) -> None:
        super().__init__(name)
        refuse_unmodelled("LayerNormLinear", parameters_split=parameters_split is not None,
                          return_layernorm_output=return_layernorm_output, ub_overlap_ag=ub_overlap_ag,
                          ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
                          ub_bulk_wgrad=ub_bulk_wgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                          delay_wgrad_compute=delay_wgrad_compute, symmetric_ar_type=symmetric_ar_type is not None)
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.normalization = normalization
        assert normalization in ["LayerNorm", "RMSNorm"], "Unsupported normalization type!"
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.return_layernorm_output = return_layernorm_output
        self.zero_centered_gamma = zero_centered_gamma
        self.eps = eps
        self.get_rng_state_tracker = get_rng_state_tracker
        if parallel_mode == "row":
            raise NotImplementedError("Normalization does not support tensor-parallel distribution.")
        setup_tp(self, tp_group, tp_size, parallel_mode, sequence_parallel)
        self.register_parameter("layer_norm_weight", torch.nn.Parameter(
            torch.empty(self.in_features, device=device, dtype=params_dtype)),
            init_fn=init_method_constant(float(not zero_centered_gamma)))
        if normalization != "RMSNorm":
            self.register_parameter("layer_norm_bias", torch.nn.Parameter(
                torch.empty(self.in_features, device=device, dtype=params_dtype)), init_fn=init_method_constant(0.0))
        else:
            self.layer_norm_bias = None
        add_weight_and_bias(self, device=device, params_dtype=params_dtype,
                            init_method=init_method or get_default_init_method(),
                            get_rng_state_tracker=get_rng_state_tracker)
        self.reset_parameters(defer_init=torch.device(device).type == "meta")

    def reset_parameters(self, defer_init=False):
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            self.layer_norm_weight.sequence_parallel = self.sequence_parallel
            if self.normalization != "RMSNorm":
                self.layer_norm_bias.sequence_parallel = self.sequence_parallel
            mark_tp(self, ["weight"], ["bias"])

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        refuse_unmodelled("LayerNormLinear.forward", fp8_output=fp8_output, fp8_grad=fp8_grad)
        inp = self.prepare_forward(inp)
        ln_out = normalize(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.zero_centered_gamma,
                           self.normalization)
        out = parallel_gemm(self, ln_out, self.weight, self.bias, is_first_microbatch)
        return (out, self.bias) if self.return_bias else out


__all__ = ["LayerNormLinear"]
