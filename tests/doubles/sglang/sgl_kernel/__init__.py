"""TEST DOUBLE of sgl_kernel, SGLang's kernel package, for SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1).

The registry's kernel package for sglang 0.5.23 (sglang-kernel 0.4.10) is a CUDA build; SGLang's CPU
engine needs the CPU build of sgl-kernel (sgl-kernel/csrc/cpu, built from source). This module stands
in for the part of it that SGLang's CPU path uses for the project's families (Qwen2, Qwen3, Llama 3.x,
Qwen3-MoE; float32, attention_backend="torch_native"), read from sglang 0.5.23:

- Imported by name when `is_cpu()`, at module level, so the engine does not start without them:
    mem_cache/allocation.py            assign_req_to_token_pool_cpu
    kernels/ops/kvcache/cache_move.py  copy_all_layer_kv_cache_cpu
    kernels/ops/speculative/*.py       assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu,
                                       build_tree_kernel_efficient_cpu, fill_accept_out_cache_loc_cpu,
                                       fill_bonus_tokens_cpu, verify_tree_greedy_cpu, rotate_input_ids_cpu
- Called: none of them on the project's path. assign_req_to_token_pool_cpu runs for speculative
  decoding's KV allocation (allocation.py alloc_for_spec_decode) and copy_all_layer_kv_cache_cpu for
  KV moves (memory_pool.py, pools built with enable_kv_cache_copy). The two are modelled all the same
  (below: each follows its C++ source, tests/unit/test_sglang_kernel_double.py pins it against plain
  torch), so a SGLang change that starts calling them on this path computes the right thing. The seven
  speculative-decoding names raise: the project never runs speculative decoding.
- torch.ops.sgl_kernel.*: SGLang calls those (rmsnorm_cpu, silu_and_mul_cpu, rotary_embedding_cpu,
  fused_experts_cpu, topk_softmax_cpu, ...) only when `cpu_has_amx_support()` (utils/common.py), which
  needs the op `torch.ops.sgl_kernel.convert_weight_packed`. This double registers no torch op, so
  SGLang takes its native torch path (forward_native) for every layer, on any CPU, AMX or not.

Not a package users install: it lives under tests/doubles and is put on PYTHONPATH by
tests/helpers/sglang_world.py only.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+test-double"

_INDEX_TYPES = (torch.int32, torch.int64)  # AT_DISPATCH_INDEX_TYPES


def _check_input(name: str, t: torch.Tensor) -> None:
    """CHECK_INPUT of sgl-kernel/csrc/cpu/common.h: a CPU tensor, contiguous."""
    if t.device.type != "cpu":
        raise RuntimeError(f"{name} must be a CPU tensor")
    if not t.is_contiguous():
        raise RuntimeError(f"{name} must be contiguous")


def _check_index(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _INDEX_TYPES:
        raise RuntimeError(f'"{name}" not implemented for \'{t.dtype}\'')


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """sgl-kernel/csrc/cpu/spec.cpp (sgl-project/sglang 69a2140), assign_req_to_token_pool_cpu and
    assign_req_to_token_pool_kernel_impl: for request i (its slots out_cache_loc[prefix[i]:prefix[i+1]],
    prefix the exclusive cumulative sum of end - start),
        req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = those slots, as int32.
    req_to_token: [max_num_reqs, pool_len] int32, written in place; out_cache_loc int64."""
    for name, t in (("req_pool_indices", req_pool_indices), ("req_to_token", req_to_token),
                    ("start_offset", start_offset), ("end_offset", end_offset), ("out_cache_loc", out_cache_loc)):
        _check_input(name, t)
    if req_to_token.dtype != torch.int32:
        raise RuntimeError(f"req_to_token must be int32, got {req_to_token.dtype}")
    if out_cache_loc.dtype != torch.int64:
        raise RuntimeError(f"out_cache_loc must be int64, got {out_cache_loc.dtype}")
    if end_offset.dtype != start_offset.dtype:
        raise RuntimeError("end_offset and start_offset must have one dtype")
    _check_index("assign_req_to_token_pool_rpi", req_pool_indices)
    _check_index("assign_req_to_token_pool_offsets", start_offset)
    flat = req_to_token.view(-1)  # the kernel indexes rtt_ptr + rpi * pool_len, whatever the shape
    prefix = 0
    for rpi, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        row = rpi * int(pool_len)
        flat[row + start: row + end] = out_cache_loc[prefix: prefix + (end - start)].to(torch.int32)
        prefix += end - start


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """sgl-kernel/csrc/cpu/kvcache.cpp (sgl-project/sglang 0e71686), copy_all_layer_kv_cache_cpu: for
    every K/V buffer b (base address data_ptrs[b], uint64; strides[b] bytes per slot row, int64),
        buf_b[tgt_loc[i], :] = buf_b[src_loc[i], :]   for every i,
    all source rows of a buffer staged before any target row is written (gather, then scatter), so
    overlapping locations copy as the Triton kernel does. Raw memory, as the kernel: ctypes.memmove."""
    for name, t in (("data_ptrs", data_ptrs), ("strides", strides), ("tgt_loc", tgt_loc), ("src_loc", src_loc)):
        _check_input(name, t)
    if data_ptrs.dtype != torch.uint64:
        raise RuntimeError(f"data_ptrs must be uint64, got {data_ptrs.dtype}")
    if strides.dtype != torch.int64:
        raise RuntimeError(f"strides must be int64, got {strides.dtype}")
    if tgt_loc.dtype != src_loc.dtype:
        raise RuntimeError("tgt_loc and src_loc must have one dtype")
    if strides.numel() != data_ptrs.numel() or src_loc.numel() != tgt_loc.numel():
        raise RuntimeError("copy_all_layer_kv_cache_cpu: data_ptrs/strides or tgt_loc/src_loc sizes differ")
    _check_index("copy_all_layer_kv_cache_cpu", tgt_loc)
    if data_ptrs.numel() == 0 or tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.tolist(), src_loc.tolist()
    for base, stride in zip(data_ptrs.view(torch.int64).tolist(), strides.tolist()):
        base &= (1 << 64) - 1  # the uint64 address, read through int64
        staging = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, staging):
            ctypes.memmove(base + t * stride, row, stride)


def _speculative_only(name: str, source: str):
    def not_modelled(*args, **kwargs):
        raise NotImplementedError(f"test double of sgl_kernel: {name} ({source}) serves speculative decoding, "
                                  "which the project does not run; it is not modelled")

    not_modelled.__name__ = name
    return not_modelled


# Imported by SGLang's speculative-decoding modules when is_cpu() (kernels/ops/speculative/spec_tree.py,
# spec_utils.py, ...); their C++ is sgl-kernel/csrc/cpu/spec.cpp.
assign_draft_cache_locs_contiguous_cpu = _speculative_only("assign_draft_cache_locs_contiguous_cpu", "spec.cpp")
assign_extend_cache_locs_cpu = _speculative_only("assign_extend_cache_locs_cpu", "spec.cpp")
build_tree_kernel_efficient_cpu = _speculative_only("build_tree_kernel_efficient_cpu", "spec.cpp")
fill_accept_out_cache_loc_cpu = _speculative_only("fill_accept_out_cache_loc_cpu", "spec.cpp")
fill_bonus_tokens_cpu = _speculative_only("fill_bonus_tokens_cpu", "spec.cpp")
verify_tree_greedy_cpu = _speculative_only("verify_tree_greedy_cpu", "spec.cpp")
rotate_input_ids_cpu = _speculative_only("rotate_input_ids_cpu", "spec.cpp")  # multi_layer_eagle.py
