"""Global normalizers of one mini-batch, counted once before its first micro-batch runs.

VAPO's token-level losses (../shared/VAPO.md, "The parallel-aware form") divide by counts over
the WHOLE global mini-batch: N response tokens, N_pos tokens of correct responses, M responses
with at least one response token (the sample-level ablation's normalizer: an empty response has
no per-token mean and adds nothing to the loss, so it does not dilute the others' weight 1/M;
docs/normalization.md).
Each DP rank counts its share and one all-reduce over the DP group gives the totals. A
micro-batch-local count would reintroduce the sample-level bias (N) or make the NLL weight grow
with the number of micro-batches and ranks (N_pos).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vapo_megatron import parallel
from vapo_megatron.batch import RolloutBatch


@dataclass(frozen=True)
class GlobalCounts:
    tokens: int       # N
    pos_tokens: int   # N_pos
    responses: int    # M: responses with >= 1 response token


def global_counts(batch: RolloutBatch, dp_group=None) -> GlobalCounts:
    """Totals over every DP rank's part of the mini-batch (one all-reduce)."""
    mask = batch.mask
    local = torch.tensor(
        [mask.sum(), (mask * batch.correct.unsqueeze(1).float()).sum(), (mask.sum(dim=1) > 0).sum()],
        dtype=torch.float64,
    )
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        parallel.all_reduce(local, group=dp_group)
    n, n_pos, m = (int(round(v)) for v in local.tolist())
    return GlobalCounts(tokens=n, pos_tokens=n_pos, responses=m)
