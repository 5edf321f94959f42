"""The one interface every rollout engine implements.

A trainer step talks to an engine in this order (VAPO section 2: each step samples G responses
per prompt from the current policy, so the engine must hold the newest actor weights):

    engine.resume_memory()                      # GPU engines: get weights/KV cache back
    engine.begin_weight_update()
    for bucket in buckets: engine.load_bucket(bucket)   # bounded groups of full HF tensors
                                                # (or writes into engine.weight_slot(name, shape))
    engine.end_weight_update(version=train_step)
    outs = engine.generate(prompt_ids, SamplingParams(n=G, ...))
    engine.release_memory()                     # GPU engines: give memory back to training

Weights travel as plain Hugging Face names with full (unsharded) tensors, separate q/k/v and
gate/up projections; each engine slices or copies what it needs.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Literal, Sequence

import torch

if TYPE_CHECKING:
    from vapo_megatron.rollout.buckets import FlatBucket


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings. n samples are drawn for every prompt.

    temperature == 0 means greedy. top_k <= 0 and top_p >= 1 switch those filters off. Sample
    j of prompt i uses seed `seed + i * n + j`, so results do not depend on batching.
    return_routes: each output also carries the experts every token was routed to (routing
    replay, data/routes.py; mixture-of-experts models only).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    return_routes: bool = False

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")

    def sample_seed(self, prompt_index: int, sample_index: int) -> int:
        return self.seed + prompt_index * self.n + sample_index


@dataclass
class RolloutOutput:
    """One sampled response. `logprobs[t]` = log_softmax(logits / temperature)[token t]
    as the engine computed it (None when the engine did not return them). `routes`: the experts
    the engine routed each token to, [prompt + response - 1, moe_layers, k] (data/routes.py),
    when asked for (SamplingParams.return_routes)."""

    prompt_index: int
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]
    logprobs: list[float] | None = None
    weight_version: int | None = None
    routes: torch.Tensor | None = None
    token_versions: list[int] | None = None  # partial rollout: the weight version of each token


@dataclass(frozen=True)
class Continuation:
    """One response to grow (partial rollout): its prompt, the tokens it has so far (maybe none),
    its own sampling seed, and at most how many tokens to add now. Token t of a response is drawn
    with the randomness the one-go generation of that seed draws it with, so a response grown in
    pieces is the response generated in one go (with the same weights)."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    seed: int
    max_new_tokens: int


@dataclass
class WeightUpdateStats:
    """What one weight update moved, for logs and the memory-bound checks."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    names: list[str] = field(default_factory=list)


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's names for what an engine can release


class RolloutEngine(abc.ABC):
    """Sampling plus in-place weight loading. Weight updates stream bounded buckets; an engine
    never needs the whole state dict at once."""

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[RolloutOutput]:
        """n samples per prompt, grouped by prompt: outputs[i * n + j] is sample j of prompt i."""

    def extend(self, requests: Sequence[Continuation], params: SamplingParams) -> list[RolloutOutput]:
        """Each request's next tokens (at most its max_new_tokens; params gives the rest of the
        sampling settings, its n, seed and max_new_tokens unused): outputs[i] holds only the new
        tokens of request i, finish_reason "length" when its budget ended it."""
        raise NotImplementedError(f"{type(self).__name__} cannot continue responses (rollout.partial)")

    @abc.abstractmethod
    def begin_weight_update(self) -> None:
        """Open an update session (SGLang refuses weight loads outside one)."""

    @abc.abstractmethod
    def load_bucket(self, named_tensors: "FlatBucket | Sequence[tuple[str, torch.Tensor]]") -> None:
        """Load one bucket of full HF-named tensors (all of one dtype) into the live weights.
        The bucket's memory may be reused once this returns: copy what must be kept."""

    def weight_slot(self, name: str, shape: torch.Size) -> torch.Tensor | None:
        """Inside an update session: a tensor of `shape` that the caller may write the full HF
        tensor `name` into directly (copy_ casts to its dtype), which loads it; None means
        "use load_bucket". Engines that hold their weights in this process return the live
        parameter, so weight sync writes TP shards into it with no copy in between."""
        return None

    @abc.abstractmethod
    def end_weight_update(self, version: int) -> None:
        """Close the session; drop caches computed with old weights; record the version."""

    @abc.abstractmethod
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free what the engine holds on the accelerator while the trainer runs: any of
        "weights", "kv_cache", "cuda_graph". Released weights must be loaded again (a weight
        update) before the next generate."""

    @abc.abstractmethod
    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Take back what release_memory freed."""

    def sync_freed(self) -> None:
        """Called by every rank that holds this engine before the engine takes GPU memory back
        (its KV cache, its weights): each rank empties PyTorch's cache (mcore/memory.py), and an
        engine spread over several ranks' GPUs returns only once all of them have (SGLang: a
        barrier on the engine group), so the owner never resumes into memory another rank's
        allocator still keeps. An engine of one process has nobody else to wait for."""
        from vapo_megatron.mcore.memory import free_cached_memory

        free_cached_memory()

    @property
    def generates(self) -> bool:
        """Whether generate runs on this rank (an engine spread over several ranks generates on
        the one that owns it; the others only take part in weight updates)."""
        return True

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The training step whose weights the engine serves (-1: initial weights)."""

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *, bucket_bytes: int = 1 << 30
    ) -> WeightUpdateStats:
        """Convenience for a single process: bucket a stream of tensors and load it."""
        from vapo_megatron.rollout.buckets import FlatBucket

        stats = WeightUpdateStats()
        bucket = FlatBucket(bucket_bytes)
        self.begin_weight_update()
        for name, tensor in named_tensors:
            if not bucket.fits(tensor):
                self.load_bucket(bucket)
                stats.buckets += 1
                bucket.clear()
            bucket.add(name, tensor)
            stats.tensors += 1
            stats.bytes += tensor.numel() * tensor.element_size()
            stats.names.append(name)
        if len(bucket):
            self.load_bucket(bucket)
            stats.buckets += 1
        self.end_weight_update(version)
        return stats
