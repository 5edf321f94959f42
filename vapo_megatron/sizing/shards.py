"""Each distinct rank's actor and critic shards, built on the meta device with megatron's own
providers (mcore/models.py), inside this one process with torch's fake process group
(mcore/parallel.py, init_fake): megatron's parameter counts, vocabulary padding and pipeline
placement of embedding, LM head and value head included."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSize:
    """Parameter counts of one distinct rank position (all its virtual-pipeline chunks)."""

    tp_rank: int
    pp_rank: int
    actor_params: int  # every parameter on this rank (what its memory holds)
    critic_params: int
    # This rank's share of the model's distinct parameters: TP-sharded tensors count on every TP
    # rank, TP-replicated ones (norms, the critic's value head) on tp_rank 0 only. Summed over all
    # positions: the model's parameter count (with megatron's padded vocabulary).
    actor_unique: int
    critic_unique: int
    # Micro-batches (model-chunk micro-batches with VPP) whose activations this pipeline rank holds
    # at its peak: megatron's own warm-up count for the training schedule + the one in 1F1B.
    inflight_microbatches: int


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
    (TP fastest, PP slowest); init_fake's parallel state is checked against it."""
    return tp_rank + tp * dp * pp_rank


def shard_sizes(actor_hf: dict, critic_hf: dict, *, world_size: int, tp: int, pp: int, vpp: int | None,
                params_dtype: torch.dtype) -> list[ShardSize]:
    """Build actor and critic shards of every distinct (tp_rank, pp_rank) on the meta device."""
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks

    dp = world_size // (tp * pp)
    out = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            parallel.init_fake(world_size, global_rank(tp_rank, pp_rank, tp=tp, dp=dp), tp, pp, vpp)
            try:
                where = (parallel.tp_rank(), parallel.pp_rank(), parallel.dp_rank())
                if where != (tp_rank, pp_rank, 0):
                    raise RuntimeError(f"megatron placed rank {global_rank(tp_rank, pp_rank, tp=tp, dp=dp)} at "
                                       f"(tp, pp, dp)={where}, expected {(tp_rank, pp_rank, 0)}")
                inflight = peak_inflight_microbatches(pp, vpp)
                counts, unique = [], []
                for hf_cfg, critic in ((actor_hf, False), (critic_hf, True)):
                    with torch.device("meta"):
                        chunks = build_chunks(hf_cfg, params_dtype=params_dtype, critic=critic, on_gpu=False)
                    params = [p for c in chunks for p in c.parameters()]
                    counts.append(sum(p.numel() for p in params))
                    unique.append(sum(p.numel() for p in params
                                      if tp_rank == 0 or getattr(p, "tensor_model_parallel", False)))
                    del chunks, params
            finally:
                parallel.destroy()
            out.append(ShardSize(tp_rank, pp_rank, counts[0], counts[1], unique[0], unique[1], inflight))
    return out


__all__ = ["ShardSize", "global_rank", "peak_inflight_microbatches", "shard_sizes"]
