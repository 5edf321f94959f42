"""Overlong reward shaping (DAPO, arXiv 2503.14476, sec. 3.4): a soft length penalty.

A response of L tokens, with L_max = rollout.max_new_tokens and a buffer of B tokens before it,
gets a penalty added to its verifier score:
    0                                      L <= L_max - B
    -penalty * (L - (L_max - B)) / B       L_max - B < L <= L_max
so it grows linearly and reaches -penalty at L_max, where the engine truncates the response.
It tells the policy that long answers are costly before they are cut off, instead of the hard
punishment of a truncated answer's wrong reward alone. Any estimator; off when B = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OverlongShaping:
    max_new_tokens: int  # rollout.max_new_tokens: L_max
    buffer: int          # reward.overlong_buffer: B (0: off)
    penalty: float       # reward.overlong_penalty: the penalty at L_max

    def __call__(self, response_lens: torch.Tensor) -> torch.Tensor:
        """[B] float32 penalties (<= 0) for response lengths [B]."""
        if self.buffer == 0:
            return torch.zeros(len(response_lens))
        start = self.max_new_tokens - self.buffer
        over = (response_lens.double() - start).clamp(min=0, max=self.buffer)
        return (-self.penalty * over / self.buffer).float()


__all__ = ["OverlongShaping"]
