"""Test double of transformer_engine/pytorch/cpp_extensions/gemm.py `general_gemm` (~191), which
megatron-core calls for the MoE router's gating GEMM when TE imports (moe_utils.py
RouterGatingLinearFunction, through extensions/transformer_engine.py te_general_gemm; TE 2.20's
module/base.py has no get_workspace, so megatron passes no workspace).

As cuBLAS computes it for TE: layout "TN", "NN" or "NT" (asserted) says whether A and B are
transposed, D = op(B) @ op(A) (TN: B @ A^T, NN: B @ A, NT: B^T @ A), accumulated in float32 from
the inputs' values and stored in out_dtype (default: A's dtype), the bias added in the forward
epilogue. Returns (D, bias_grad, gelu_input, extra_output) with the last three None.
Not modelled (NotImplementedError): quantized inputs/outputs, GELU epilogues, accumulation into
`out`, alpha/beta scaling, bias gradients, userbuffers.
"""

from __future__ import annotations

import torch

from transformer_engine.pytorch.module.base import refuse_unmodelled


def general_gemm(A: torch.Tensor, B: torch.Tensor, out_dtype=None, quantization_params=None, gelu: bool = False,
                 gelu_in=None, alpha: float = 1.0, beta=None, accumulate: bool = False, layout: str = "TN", out=None,
                 bias=None, use_split_accumulator: bool = False, grad: bool = False, ub=None, ub_type=None,
                 extra_output=None, bulk_overlap: bool = False):
    assert layout in ("TN", "NN", "NT"), f"GEMM layout {layout} not supported."
    refuse_unmodelled("general_gemm", quantization_params=quantization_params is not None, gelu=gelu,
                      accumulate=accumulate, out=out is not None, alpha=alpha != 1.0, beta=beta is not None,
                      bias_grad=grad and bias is not None, ub=ub is not None or ub_type is not None,
                      extra_output=extra_output is not None, bulk_overlap=bulk_overlap)
    a = A.float().t() if layout[0] == "T" else A.float()
    b = B.float().t() if layout[1] == "T" else B.float()
    d = b @ a
    if bias is not None:
        d = d + bias.float()
    return d.to(A.dtype if out_dtype is None else out_dtype), None, None, None


__all__ = ["general_gemm"]
