"""The step's rows between the actor's data-parallel ranks and the critic's, when the critic has a
layout of its own (critic.parallel; mcore/parallel.py roles).

The rollouts, their returns and the advantages live on the actor's DP ranks (each holds its share
of whole prompt groups, replicated over its TP and PP ranks). A critic at another TP/PP has another
DP size and rank on the same processes, so:

    rows, share = to_critic(batch, parts)        collective: the critic's rows of each mini-batch
    values = values_to_actor(critic_values, share, batch)   collective: V_t back on the actor's rows

Mini-batch i of the step is the same set of responses at both layouts: the union over the actor's
DP ranks of each one's i-th part (update.mini_batch_rows), dealt over the critic's DP ranks in
near-equal contiguous shares. So the critic's update sees the global mini-batches it would see at
the actor's layout, its token-level value loss is normalized by the same global count N
(update.global_counts, over the critic's DP), and only the order of float sums differs.

Both exchanges are object all-gathers over the world's gloo wait group: every rank makes the same
calls whatever its data. Only one rank of each TP/PP group contributes (the others hold copies).
What travels: the rows' tokens, lengths and the critic's targets (old values, returns), not the
actor's fields. Every rank receives every share; at 32B (8k responses of 16k tokens) that is a few
GB per step per rank over the host network, seconds against a step of tens of minutes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vapo_megatron.data.batch import RolloutBatch, cat_rows
from vapo_megatron.mcore import parallel


@dataclass(frozen=True)
class Share:
    """Where the critic's rows came from: origin[k] = (actor DP rank, row of that rank's batch) of
    the critic's row k; parts[i] = the critic's rows (indices into its batch) of mini-batch i."""

    origin: list[tuple[int, int]]
    parts: list[list[int]]


def _coordinates(name: str) -> tuple[int, int, bool]:
    """(DP rank, DP size, whether this rank speaks for its TP/PP group) at role `name`'s layout."""
    with parallel.role(name):
        return parallel.dp_rank(), parallel.dp_size(), parallel.tp_rank() == 0 and parallel.pp_rank() == 0


def _for_critic(batch: RolloutBatch) -> RolloutBatch:
    """What the critic reads of a row: tokens and lengths (its forward, the masks, fillers), its
    targets (values, returns) and the correct flags the counts read."""
    return RolloutBatch(tokens=batch.tokens, prompt_lens=batch.prompt_lens, response_lens=batch.response_lens,
                        rewards=batch.rewards, correct=batch.correct, group_ids=batch.group_ids,
                        values=batch.values, returns=batch.returns)


def deal(n: int, ranks: int) -> list[range]:
    """n rows over `ranks` ranks in contiguous shares whose sizes differ by at most one."""
    per, extra = divmod(n, ranks)
    starts = [r * per + min(r, extra) for r in range(ranks + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(ranks)]


def to_critic(batch: RolloutBatch, parts: list[list[int]]) -> tuple[RolloutBatch, Share]:
    """Collective over all ranks. `batch`: this actor DP rank's rows; `parts`: its rows of each
    mini-batch (the same number on every rank). Returns the critic's rows on this rank and where
    they came from."""
    a_rank, a_size, a_speaks = _coordinates("actor")
    c_rank, c_size, _ = _coordinates("critic")
    every: list = [None] * parallel.world_size()
    mine = (a_rank, _for_critic(batch), parts) if a_speaks else None
    parallel.all_gather_object(every, mine, group=parallel.wait_group())
    shares = {item[0]: item[1:] for item in every if item is not None}
    if sorted(shares) != list(range(a_size)) or len({len(p) for _, p in shares.values()}) != 1:
        raise RuntimeError(f"critic_share: actor DP shares {sorted(shares)} of {a_size}, or uneven mini-batches")
    origin: list[tuple[int, int]] = []
    my_parts: list[list[int]] = []
    for i in range(len(parts)):
        rows = [(d, r) for d in range(a_size) for r in shares[d][1][i]]
        if len(rows) < c_size:
            raise RuntimeError(f"critic_share: mini-batch {i} has {len(rows)} responses for the critic's {c_size} "
                               "DP ranks (the start-up checks refuse this layout)")
        taken = [rows[k] for k in deal(len(rows), c_size)[c_rank]]
        my_parts.append(list(range(len(origin), len(origin) + len(taken))))
        origin += taken
    pieces = [shares[d][0].select([r]) for d, r in origin]
    return cat_rows(pieces), Share(origin=origin, parts=my_parts)


def values_to_actor(values: torch.Tensor, share: Share, batch: RolloutBatch) -> torch.Tensor:
    """Collective over all ranks. The critic's values [B_critic, S] on its rows (to_critic's) back
    on this actor DP rank's rows: [B, S] of `batch`, masked to its prediction positions."""
    a_rank = _coordinates("actor")[0]
    c_speaks = _coordinates("critic")[2]
    every: list = [None] * parallel.world_size()
    parallel.all_gather_object(every, (share.origin, values) if c_speaks else None, group=parallel.wait_group())
    out = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    width = out.shape[1]
    for item in every:
        if item is None:
            continue
        origin, v = item
        for k, (d, r) in enumerate(origin):
            if d == a_rank:
                w = min(width, v.shape[1])
                out[r, :w] = v[k, :w]
    return out * batch.mask


__all__ = ["Share", "deal", "to_critic", "values_to_actor"]
