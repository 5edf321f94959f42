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
"""

from __future__ import annotations

import torch


def free_cached_memory() -> None:
    """torch.cuda.empty_cache(): unused cached blocks back to the driver, where the engine's
    allocations can use them. Tensors in use are untouched. No-op without CUDA (CPU runs)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
