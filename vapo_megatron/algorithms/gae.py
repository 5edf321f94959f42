"""Generalized advantage estimation for right-padded response batches (VAPO sec. 3).

Shapes: B responses, T response positions. ``mask[b, t]`` is 1 on the real tokens of response
b, which occupy positions 0..len_b-1 (right padding). ``values[b, t]`` is V(s_t), the critic's
output at the position that predicts token t; the value after the last token is 0.

Decoupled GAE (VAPO component 2) is two calls: lam=1.0 for the critic's returns and the
(length-adaptive, component 3) per-response lam_policy for the policy's advantages.

The reverse recurrence A_t = delta_t + g * A_{t+1} (g = gamma * lam, per response) is computed
as a chunked scan instead of a loop over T positions: inside a chunk of C positions,
A = D @ delta with the upper-triangular discount matrix D[i, j] = g^(j - i), one batched matmul
for every chunk of every response; the chunks are then linked backwards by a loop over T/C
chunk heads, A_t += g^(C - i) * A_(next chunk head). Only non-negative powers of g <= 1 appear,
so it is stable for any T and any g in [0, 1] (no division by g^t as in a cumsum trick).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Positions per chunk. Work is B*T*C multiply-adds plus T/C small steps; 64 balances the two
# on CPUs and GPUs alike (measured by benchmarks/algo.py).
_CHUNK = 64
# Responses per length group (see compute_gae).
_GROUP = 64


def length_adaptive_lambda(lengths: Tensor, alpha: float) -> Tensor:
    """lambda_policy_i = clamp(1 - 1 / (alpha * |o_i|), 0, 1), VAPO component 3.

    lengths: [B] response lengths (tokens). With alpha = 0.05, responses of 20 tokens or
    fewer get lambda 0 (pure TD(0) advantages). Returns [B] float32.
    """
    if alpha <= 0:
        raise ValueError(f"length-adaptive GAE needs alpha > 0, got alpha={alpha}")
    lengths = lengths.to(torch.float64)
    # A zero length would divide by zero: it has no tokens, so its lambda is irrelevant; give 0.
    lam = 1.0 - 1.0 / (alpha * lengths.clamp(min=1e-12))
    return lam.clamp(0.0, 1.0).to(torch.float32)


def _check_shapes(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor) -> None:
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(
            f"compute_gae needs rewards, values and mask of one shape [B, T]; got rewards "
            f"{tuple(rewards.shape)}, values {tuple(values.shape)}, mask {tuple(mask.shape)}"
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"compute_gae needs gamma in [0, 1], got gamma={gamma}")
    if isinstance(lam, Tensor):
        if lam.shape != rewards.shape[:1]:
            raise ValueError(f"per-response lam must have shape [B]={tuple(rewards.shape[:1])}, got {tuple(lam.shape)}")
        if bool(((lam < 0) | (lam > 1)).any()):
            raise ValueError("per-response lam must lie in [0, 1]")
    elif not 0.0 <= lam <= 1.0:
        raise ValueError(f"compute_gae needs lam in [0, 1], got lam={lam}")


def compute_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns for a right-padded batch.

    rewards, values, mask: [B, T]; lam: float or [B] (per response). Returns (advantages,
    returns), both [B, T] float32 with zeros on padding, where
    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token is 0),
    A_t = sum_k (gamma * lam)^k delta_{t+k} within the response, returns = A + V.

    Responses are processed in groups of similar length (sorted), each group only over its
    own longest length, so the work follows the real tokens rather than B * T: RL batches
    have long-tailed lengths and are mostly padding.
    """
    _check_shapes(rewards, values, mask, gamma, lam)
    B, T = rewards.shape
    device = rewards.device
    advantages = torch.zeros(B, T, dtype=torch.float32, device=device)
    returns = torch.zeros(B, T, dtype=torch.float32, device=device)
    if B == 0 or T == 0:
        return advantages, returns
    lengths = right_padded_lengths(mask)  # [B] int64
    if isinstance(lam, Tensor):
        g = gamma * lam.to(device=device, dtype=torch.float64)  # [B]
    else:
        g = torch.full((B,), gamma * lam, dtype=torch.float64, device=device)

    order = torch.argsort(lengths, descending=True)
    sorted_len = lengths[order].tolist()
    positions = torch.arange(T, device=device)
    for start in range(0, B, _GROUP):
        idx = order[start : start + _GROUP]
        L = sorted_len[start]  # the group's longest response
        if L == 0:
            break
        real = positions[None, :L] < lengths[idx][:, None]  # [G, L]
        # where (not multiply) so that NaN/inf on padding cannot leak in.
        r_g = torch.where(real, rewards[:, :L].index_select(0, idx).to(torch.float32), 0.0)
        v_g = torch.where(real, values[:, :L].index_select(0, idx).to(torch.float32), 0.0)
        adv_g = _discounted_reverse_cumsum(_td_errors(r_g, v_g, gamma), g[idx])
        advantages[:, :L].index_copy_(0, idx, adv_g)
        returns[:, :L].index_copy_(0, idx, adv_g.add_(v_g))
    return advantages, returns


def right_padded_lengths(mask: Tensor) -> Tensor:
    """[B] lengths of a right-padded [B, T] mask; ValueError naming a row with a hole."""
    u = (mask if mask.dtype == torch.bool else mask != 0).view(torch.uint8)
    if u.shape[1] > 1:
        # Consecutive differences are 0 or 255 (1 -> 0) on a right-padded row; 1 marks 0 -> 1.
        step = torch.diff(u, dim=1)
        if int(step.add_(1).amax()) == 2:
            bad = int((step == 2).any(1).nonzero()[0])
            raise ValueError(
                f"masks must be right-padded (1s then 0s per row); row {bad} has a 0 before a 1"
            )
    # Each row of 1 - u is sorted (0s then 1s): the first 1 is at the row's length.
    ones = torch.ones(u.shape[0], 1, dtype=torch.uint8, device=u.device)
    return torch.searchsorted((1 - u).contiguous(), ones).squeeze(1)


def _td_errors(r: Tensor, v: Tensor, gamma: float) -> Tensor:
    """delta_t = r_t + gamma * V_{t+1} - V_t with V = 0 after the last column; [G, L]."""
    delta = r - v
    delta[:, :-1].add_(v[:, 1:], alpha=gamma)
    return delta


def _discounted_reverse_cumsum(delta: Tensor, g: Tensor) -> Tensor:
    """A_t = sum_{k>=0} g^k delta_{t+k} per row; delta [G, L] float32, g [G] float64 in [0, 1]."""
    G, L = delta.shape
    device = delta.device
    C = min(_CHUNK, L)
    n = -(-L // C)
    if n * C != L:
        delta = torch.nn.functional.pad(delta, (0, n * C - L))
    # Powers in float64, then float32: g^k for k = 0..C. (0^0 = 1 keeps g = 0 exact.)
    k = torch.arange(C + 1, dtype=torch.float64, device=device)
    gpow = g[:, None] ** k[None, :]  # [G, C+1]
    # Dt[b, j, i] = g_b^(j - i) for j >= i, else 0, so that delta_chunk[b, c, :] @ Dt[b] is the
    # within-chunk part of A at every position i of chunk c. Built as a Toeplitz matrix from
    # z[b, k] = g_b^(k - (C-1)) (0 for k < C-1): windows z[j : j+C] give z[j + t] = g^(j-(C-1-t)),
    # and flipping t -> i = C-1-t gives g^(j - i).
    z = torch.cat([delta.new_zeros(G, C - 1), gpow[:, :C].to(torch.float32)], dim=1)  # [G, 2C-1]
    Dt = z.unfold(1, C, 1).flip(2)  # [G, C(j), C(i)], contiguous
    adv = torch.bmm(delta.view(G, n, C), Dt)  # [G, n, C]
    if n > 1:
        # Link the chunks backwards: carry[:, c] = A at the first position of chunk c+1.
        gC = gpow[:, C].to(torch.float32)  # [G]
        heads = adv[:, :, 0]  # [G, n] (view): local A at each chunk's first position
        carry = torch.zeros(G, n, dtype=torch.float32, device=device)
        nxt = heads[:, n - 1]
        for c in range(n - 2, -1, -1):
            carry[:, c] = nxt
            nxt = torch.addcmul(heads[:, c], gC, nxt)
        # A_t += g^(C - i) * carry, one batched rank-1 update; w[b, i] = g_b^(C - i).
        w = gpow[:, 1:].flip(1).to(torch.float32)  # [G, C]
        adv.baddbmm_(carry.unsqueeze(2), w.unsqueeze(1))
    return adv.view(G, n * C)[:, :L]
