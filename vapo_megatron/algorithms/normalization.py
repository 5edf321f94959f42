"""Global normalizers of one mini-batch, counted once before its first micro-batch runs.

VAPO's token-level losses (docs/algorithm.md, "The parallel-aware form") divide by counts over
the WHOLE global mini-batch: N response tokens, N_pos tokens of correct responses, M responses
with at least one response token (the sample-level ablation's normalizer: an empty response has
no per-token mean and adds nothing to the loss, so it does not dilute the others' weight 1/M;
docs/normalization.md).
Each DP rank counts its share (`count_sums`) and one all-reduce over the DP group gives the
totals (mcore/update.py). A micro-batch-local count would reintroduce the sample-level bias (N)
or make the NLL weight grow with the number of micro-batches and ranks (N_pos).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GlobalCounts:
    tokens: int       # N
    pos_tokens: int   # N_pos
    responses: int    # M: responses with >= 1 response token

    @classmethod
    def from_sums(cls, sums: torch.Tensor) -> "GlobalCounts":
        """From count_sums summed over the DP group."""
        n, n_pos, m = (int(round(v)) for v in sums.tolist())
        return cls(tokens=n, pos_tokens=n_pos, responses=m)


def count_sums(mask: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """[3] float64: (N, N_pos, M) of this rank's part; mask [B, S] at prediction positions, correct [B]."""
    return torch.tensor(
        [mask.sum(), (mask * correct.unsqueeze(1).float()).sum(), (mask.sum(dim=1) > 0).sum()],
        dtype=torch.float64,
    )


__all__ = ["GlobalCounts", "count_sums"]
