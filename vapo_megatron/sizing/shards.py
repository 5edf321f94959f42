"""Each distinct rank's actor and critic shards, built on the meta device with megatron's own
providers (mcore/models.py), inside this one process with torch's fake process group
(mcore/parallel.py, init_fake): megatron's parameter counts, vocabulary padding and pipeline
placement of embedding, LM head and value head included. Without a critic (algo.estimator=grpo)
only the actor's shards are built and the critic's counts are 0."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class ShardSize:
    """Parameter counts of one distinct rank position (all its virtual-pipeline chunks)."""

    tp_rank: int
    pp_rank: int
    actor_params: int  # every parameter on this rank (what its memory holds)
    critic_params: int  # 0 without a critic (none built)
    # This rank's share of the model's distinct parameters: TP-sharded tensors count on every TP
    # rank, TP-replicated ones (norms, the critic's value head) on tp_rank 0 only; routed experts
    # x EP (the other EP ranks of this position hold the other experts). Summed over all
    # positions: the model's parameter count (with megatron's padded vocabulary).
    actor_unique: int
    critic_unique: int
    # Micro-batches (model-chunk micro-batches with VPP) whose activations this pipeline rank holds
    # at its peak: megatron's own warm-up count for the training schedule + the one in 1F1B.
    inflight_microbatches: int
    # Of *_params: the routed experts' parameters on this rank (E/EP experts of each of its MoE
    # layers). Megatron's DDP reduces their gradients over the expert-data-parallel group and the
    # distributed optimizer shards their state over it (DP/EP ranks), the rest over DP.
    actor_expert: int = 0
    critic_expert: int = 0
    # For a checkpoint's load (memory.checkpoint_parts): the largest parameter on this rank, and the
    # parameters megatron's load concatenates anew (its ShardedTensorFactory merges: SwiGLU's
    # linear_fc1, gate and up rows, mlp.py apply_swiglu_sharded_factory), elements.
    actor_largest: int = 0
    critic_largest: int = 0
    actor_merged: int = 0
    critic_merged: int = 0


def peak_inflight_microbatches(pp: int, vpp: int | None, *, num_microbatches: int = 1024) -> int:
    """For the rank megatron's parallel state is initialized as: how many (chunk) micro-batches its
    training schedule keeps activations for at once, from megatron's own schedule arithmetic
    (get_pp_rank_microbatches: 1F1B warms up pp - rank - 1 micro-batches, the interleaved schedule
    (pp - rank - 1) * 2 + (vpp - 1) * pp chunk micro-batches), + 1 for the micro-batch in 1F1B.
    `num_microbatches`: a mini-batch has many (it is split by token budget), so no cap applies."""
    if pp == 1:
        return 1
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    _, _, warmup, _ = get_pp_rank_microbatches(num_microbatches, vpp or 1, pp, forward_only=False)
    return warmup + 1


def global_rank(tp_rank: int, pp_rank: int, *, tp: int, dp: int) -> int:
    """Global rank of (tp_rank, pp_rank, dp_rank=0) in megatron's default order tp-cp-ep-dp-pp
    (TP fastest, PP slowest); init_fake's parallel state is checked against it.

    With EP, megatron lays the expert grid out in the same order over (expert TP = TP, EP,
    expert-DP = DP/EP, PP) (parallel_state.initialize_model_parallel, expert_decoder_rank_generator):
    a rank's dp_rank is ep_rank + EP x expert_dp_rank, so dp_rank 0 is ep_rank 0 and expert-DP
    rank 0, and its expert TP rank is its tp_rank."""
    return tp_rank + tp * dp * pp_rank


def is_expert(name: str) -> bool:
    """A routed expert's parameter, by megatron's name: `mlp.experts.local_experts.{k}.*`
    (SequentialMLP) or `mlp.experts.linear_fc{1,2}.weight{k}` (TE's grouped GEMM). The router
    (`mlp.router.weight`) is replicated over EP and TP, a dense parameter."""
    return ".mlp.experts." in f".{name}"


def shard_sizes(actor_hf: dict, critic_hf: dict | None, *, world_size: int, tp: int, pp: int, vpp: int | None,
                params_dtype: torch.dtype, ep: int = 1, sequence_parallel: bool = False) -> list[ShardSize]:
    """Build actor and critic shards of every distinct (tp_rank, pp_rank) on the meta device, at
    dp_rank 0 (hence ep_rank 0; every EP rank holds as many experts). critic_hf None: no critic,
    the actor's shards alone (its counts 0). sequence_parallel: the run's, so megatron builds the
    models as the run will (it does not change a parameter's size)."""
    layout = (world_size, tp, pp, vpp, params_dtype, ep, sequence_parallel)
    actor = _model_counts(actor_hf, False, *layout)
    critic = (_model_counts(critic_hf, True, *layout) if critic_hf is not None
              else [Counts(0, 0, 0, 0, 0, 0)] * len(actor))
    return [ShardSize(a.tp_rank, a.pp_rank, a.params, c.params, a.unique, c.unique, a.inflight, a.expert, c.expert,
                      a.largest, c.largest, a.merged, c.merged)
            for a, c in zip(actor, critic)]


def critic_shard_sizes(critic_hf: dict, *, world_size: int, tp: int, pp: int, vpp: int | None,
                       params_dtype: torch.dtype, ep: int = 1, sequence_parallel: bool = False) -> list[ShardSize]:
    """The critic's shards at a layout of its own (critic.parallel), one per distinct (tp_rank,
    pp_rank) of that layout; the actor's counts 0 (its shards are built at its own layout)."""
    counts = _model_counts(critic_hf, True, world_size, tp, pp, vpp, params_dtype, ep, sequence_parallel)
    return [ShardSize(c.tp_rank, c.pp_rank, 0, c.params, 0, c.unique, c.inflight, 0, c.expert, 0, c.largest, 0,
                      c.merged) for c in counts]


def paired_positions(world_size: int, actor: tuple[int, int], critic: tuple[int, int], actor_shards: list[ShardSize],
                     critic_shards: list[ShardSize]) -> list[tuple[ShardSize, ShardSize]]:
    """(actor shard, critic shard) of every distinct pair that some GPU holds, when the critic has
    its own (tp, pp): both models place global rank g in megatron's order (TP fastest, PP slowest),
    tp_rank g % tp and pp_rank g // (world / pp), each at its own sizes. A list with one position
    per stage (layer_counts.py: tp_rank 0, TP ranks folded) stands for every TP rank of the stage."""
    def index(shards: list[ShardSize]) -> dict:
        return {(s.tp_rank, s.pp_rank): s for s in shards}

    def at(shards: dict, tp: int, pp: int, g: int) -> ShardSize:
        where = (g % tp, g // (world_size // pp))
        return shards[where] if where in shards else shards[(0, where[1])]

    a, c = index(actor_shards), index(critic_shards)
    pairs = dict.fromkeys((at(a, *actor, g), at(c, *critic, g)) for g in range(world_size))
    return list(pairs)


class Counts(NamedTuple):
    """One model's parameter counts at one rank position (ShardSize's fields, per model)."""

    tp_rank: int
    pp_rank: int
    inflight: int
    params: int
    unique: int
    expert: int
    largest: int = 0
    merged: int = 0


def _merged(chunks: list) -> int:
    """Elements of the parameters whose load megatron merges from parts (the ShardedTensorFactory
    entries of the model's sharded state dict, built here on the meta device)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return sum(x.data.numel() for c in chunks for x in nested_values(c.sharded_state_dict())
               if isinstance(x, ShardedTensorFactory))


# One model's counts per layout, kept for the process: vapo-plan with algo.estimator=grpo sizes the
# same actor twice (without and with a critic, sizing/plan.py).
_COUNTS: dict[tuple, list[Counts]] = {}


def _model_counts(hf_cfg: dict, critic: bool, world_size: int, tp: int, pp: int, vpp: int | None,
                  params_dtype: torch.dtype, ep: int, sequence_parallel: bool) -> list[Counts]:
    """One model's counts at every distinct (tp_rank, pp_rank), built on the meta device at
    tp_rank 0 of each pipeline stage: megatron gives every TP rank of a stage the same shapes
    (vocabulary padded to a multiple of TP, heads and FFN divided evenly), so the other TP ranks
    differ only in what they count as distinct, their TP-sharded parameters
    (checked on every rank against a real TP=2 model)."""
    key = (json.dumps(hf_cfg, sort_keys=True, default=str), critic, world_size, tp, pp, vpp, str(params_dtype), ep,
           sequence_parallel)
    if key in _COUNTS:
        return _COUNTS[key]
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks

    dp = world_size // (tp * pp)
    out = []
    for pp_rank in range(pp):
        rank = global_rank(0, pp_rank, tp=tp, dp=dp)
        parallel.init_fake(world_size, rank, tp, pp, vpp, ep=ep)
        try:
            where = (parallel.tp_rank(), parallel.pp_rank(), parallel.dp_rank(), parallel.ep_rank())
            if where != (0, pp_rank, 0, 0):
                raise RuntimeError(f"megatron placed rank {rank} at (tp, pp, dp, ep)={where}, "
                                   f"expected {(0, pp_rank, 0, 0)}")
            inflight = peak_inflight_microbatches(pp, vpp)
            with torch.device("meta"):
                chunks = build_chunks(hf_cfg, params_dtype=params_dtype, critic=critic, on_gpu=False,
                                      sequence_parallel=sequence_parallel)
            params = [(n, p) for c in chunks for n, p in c.named_parameters()]
            total, expert = sum(p.numel() for _, p in params), sum(p.numel() for n, p in params if is_expert(n))
            largest, merged = max(p.numel() for _, p in params), _merged(chunks)
            for tp_rank in range(tp):
                unique = sum(p.numel() * (ep if is_expert(n) else 1) for n, p in params
                             if tp_rank == 0 or getattr(p, "tensor_model_parallel", False))
                out.append(Counts(tp_rank, pp_rank, inflight, total, unique, expert, largest, merged))
            del chunks, params
        finally:
            parallel.destroy()
    _COUNTS[key] = out
    return out


__all__ = ["Counts", "ShardSize", "critic_shard_sizes", "global_rank", "is_expert", "paired_positions",
           "peak_inflight_microbatches", "shard_sizes"]
