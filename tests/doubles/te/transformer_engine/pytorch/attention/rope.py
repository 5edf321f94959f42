"""Test double of transformer_engine/pytorch/attention/rope.py `apply_rotary_pos_emb` (~346): the
rotary embedding megatron applies through TE when config.apply_rope_fusion (fused=True, "sbhd").

As TE's fused kernel (common/fused_rope/fused_rope.cu) computes it: freqs [s2, 1, 1, d2] with
s2 >= s and d2 <= d, in float32; the first d2 channels become x cos(f) + rotate_half(x) sin(f)
(rotate_half: [-x2, x1] of the two halves, or of the odd/even channels when interleaved),
computed in float32 and cast back to x's dtype; the other channels pass unchanged. The unfused
path (fused=False, ~440) takes cos/sin in x's dtype first. "thd" packing, start_positions and
context parallelism are not modelled (NotImplementedError), nor the fused QKV variant.
"""

from __future__ import annotations

import torch

from transformer_engine.pytorch.unmodelled import unmodelled


def rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1)
    return pairs.flatten(-2)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd", start_positions=None,
                         interleaved: bool = False, fused: bool = False, cu_seqlens=None, cp_size: int = 1,
                         cp_rank: int = 0) -> torch.Tensor:
    if tensor_format not in ("sbhd", "bshd") or start_positions is not None or cp_size != 1:
        raise NotImplementedError(f"test double: rotary embedding with tensor_format={tensor_format!r}, "
                                  f"start_positions or cp_size={cp_size} is not modelled")
    seq = t.size(0) if tensor_format == "sbhd" else t.size(1)
    freqs = freqs[:seq].float()
    if tensor_format == "bshd":
        freqs = freqs.transpose(0, 1)
    rot = freqs.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    if fused:
        x32 = x.float()
        out = (x32 * torch.cos(freqs) + rotate_half(x32, interleaved) * torch.sin(freqs)).to(t.dtype)
    else:
        out = x * torch.cos(freqs).to(t.dtype) + rotate_half(x, interleaved) * torch.sin(freqs).to(t.dtype)
    return torch.cat((out, rest), dim=-1)


apply_fused_qkv_rotary_pos_emb = unmodelled("attention.rope.apply_fused_qkv_rotary_pos_emb")

__all__ = ["apply_fused_qkv_rotary_pos_emb", "apply_rotary_pos_emb", "rotate_half"]
