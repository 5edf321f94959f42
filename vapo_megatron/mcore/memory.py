"""Memory handed back at the phase switches of a colocated run (trainer <-> SGLang engine).

After the updates PyTorch's caching allocator keeps the freed activations reserved: at the 32B
layout 15 GiB per GPU without sequence parallelism, 2.3 GiB with it, plus fragmentation (vapo-plan,
"activations, full recompute"). The engine's memory
comes back through the CUDA driver (SGLang's torch_memory_saver), which cannot use blocks the
trainer's allocator holds, so without a release the GPU would need resident state + cached
activations + the engine's share at once. Megatron-LM's RL path empties the cache at the same
points (--empty-unused-memory-level). Called where the phases switch: before the engine resumes
its weights (rollout/generator.py, Generator.sync_weights) and its KV cache (Generator.generate),
and after the engine has released its weights (Generator.release_weights).

Two of megatron-core's caches hold device tensors past the updates, which an empty_cache cannot
return since they are in use, and which vapo-plan does not count in the rollout phase:
- parallel_state's GlobalMemoryBuffer: one flat tensor per (name, dtype), grown to the largest
  request and kept: the sequence-parallel all-gather of a micro-batch's activations ("mpu", [T, h])
  and the local attention's baddbmm input ([b x heads, s, s], a bare GPU without TE);
- RotaryEmbedding.forward's lru_cache (maxsize 32): the [s, 1, 1, d] fp32 embedding of each
  sequence length seen, up to 32 of them, on the class, so for every model.
Both are rebuilt on their next use (a get_tensor call allocates a missing buffer; a cache miss
recomputes the embedding), so `free_cached_memory` drops them first.
"""

from __future__ import annotations

import sys

import torch


def _rotary_classes(cls: type) -> list[type]:
    return [cls] + [sub for c in cls.__subclasses__() for sub in _rotary_classes(c)]


def drop_megatron_caches() -> None:
    """Empty megatron-core's GlobalMemoryBuffer and the RoPE embeddings' lru_caches (module docstring).
    Only what megatron has loaded is touched: nothing is imported here."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if buffer is not None:
        buffer.buffer.clear()
    rotary = sys.modules.get("megatron.core.models.common.embeddings.rotary_pos_embedding")
    if rotary is not None:
        for cls in _rotary_classes(rotary.RotaryEmbedding):
            clear = getattr(cls.__dict__.get("forward"), "cache_clear", None)
            if clear is not None:
                clear()


def free_cached_memory() -> None:
    """megatron-core's caches dropped, then torch.cuda.empty_cache(): unused cached blocks back to
    the driver, where the engine's allocations can use them. Tensors in use are untouched. The
    empty_cache is a no-op without CUDA (CPU runs)."""
    drop_megatron_caches()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
