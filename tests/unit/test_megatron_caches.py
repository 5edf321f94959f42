"""mcore/memory.py: before the engine takes memory back, free_cached_memory drops megatron-core's
caches of device tensors that outlive the updates (issue 32 item 6): the GlobalMemoryBuffer
(sequence-parallel gathers, the local attention's input) and RotaryEmbedding.forward's lru_cache.
Both are rebuilt on their next use, to the same values."""

from __future__ import annotations

import pytest
import torch

from vapo_megatron.mcore.megatron_import import import_megatron

import_megatron()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: E402
from megatron.core.utils import GlobalMemoryBuffer  # noqa: E402

from vapo_megatron.mcore.memory import free_cached_memory  # noqa: E402


@pytest.fixture
def memory_buffer(monkeypatch):
    buffer = GlobalMemoryBuffer()
    monkeypatch.setattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", buffer)
    return buffer


def test_megatron_caches_are_dropped_and_rebuilt(memory_buffer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # RoPE moves its inv_freq there
    # What a sequence-parallel all-gather leaves behind: a flat buffer kept at its largest size.
    memory_buffer.buffer[("mpu", torch.bfloat16)] = torch.empty(4096, dtype=torch.bfloat16)
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)
    first = {n: rope(n) for n in (8, 24, 40)}  # one cached [n, 1, 1, 16] fp32 embedding per length
    assert RotaryEmbedding.forward.cache_info().currsize >= 3

    free_cached_memory()

    assert memory_buffer.buffer == {}
    assert RotaryEmbedding.forward.cache_info().currsize == 0
    # Rebuilt on the next use: the same embedding (a missing buffer is allocated by get_tensor, on
    # the GPU: megatron/core/utils.py).
    for n, emb in first.items():
        assert torch.equal(rope(n), emb)


def test_nothing_to_drop_is_not_an_error(monkeypatch):
    monkeypatch.setattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)  # before initialize_model_parallel
    free_cached_memory()
