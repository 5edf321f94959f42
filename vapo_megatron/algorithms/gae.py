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

    Memory: the two outputs are the only [B, T] tensors allocated. Every group works in one
    workspace allocated once per call and sized by the first group (the longest response L),
    about _GROUP x (3 L + _CHUNK^2) floats, and writes into it with out= and in-place ops; on a
    CPU, fresh memory costs a page fault per page at first touch, which on a loaded machine cost
    more than the arithmetic (issue 63; the suite bounds the allocations). The
    arithmetic is the operations of the version before, on the same shapes: its results were
    bitwise the same on the tests' batches and benchmarks/algo.py's when the buffers came in.
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
    if sorted_len[0] == 0:
        return advantages, returns
    positions = torch.arange(T, device=device)
    work = _Workspace(min(B, _GROUP), sorted_len[0], device)
    for start in range(0, B, _GROUP):
        idx = order[start : start + _GROUP]
        L = sorted_len[start]  # the group's longest response
        if L == 0:
            break
        G = idx.numel()
        C = min(_CHUNK, L)
        P = -(-L // C) * C  # L padded to whole chunks
        real = work.take("real", (G, L))
        torch.lt(positions[None, :L], lengths[idx][:, None], out=real)  # [G, L]
        # delta = r - v + gamma * v_next, in the padded [G, P] block the scan reads; where (not
        # multiply) so that NaN/inf on padding cannot leak in.
        v = _gather_rows(values, idx, L, work.take("v", (G, L)))
        torch.where(real, v, work.zero, out=v)
        padded = work.take("delta", (G, P))
        delta = _gather_rows(rewards, idx, L, padded[:, :L])
        torch.where(real, delta, work.zero, out=delta)
        delta.sub_(v)
        delta[:, :-1].add_(v[:, 1:], alpha=gamma)
        padded[:, L:].zero_()
        adv = _discounted_reverse_cumsum(padded, g[idx], C, work)[:, :L]
        advantages[:, :L].index_copy_(0, idx, adv)
        returns[:, :L].index_copy_(0, idx, adv.add_(v))
    return advantages, returns


class _Workspace:
    """compute_gae's buffers, allocated once per call for the first (longest) group and reused,
    as contiguous views, by every group after it: G rows, L positions (P padded to chunks)."""

    def __init__(self, G: int, L: int, device: torch.device):
        C = min(_CHUNK, L)
        P, f32 = -(-L // C) * C, torch.float32
        self.flat = {"real": torch.empty(G * L, dtype=torch.bool, device=device),
                     "v": torch.empty(G * L, dtype=f32, device=device),
                     "delta": torch.empty(G * P, dtype=f32, device=device),
                     "adv": torch.empty(G * P, dtype=f32, device=device),
                     "dt": torch.empty(G * C * C, dtype=f32, device=device),
                     "carry": torch.empty(G * (P // C), dtype=f32, device=device),
                     # The discount powers: g^k (float64), z, the chunk-link weights and g^C.
                     "gpow": torch.empty(G * (C + 1), dtype=torch.float64, device=device),
                     "z": torch.empty(G * (2 * C - 1), dtype=f32, device=device),
                     "w64": torch.empty(G * C, dtype=torch.float64, device=device),
                     "w": torch.empty(G * C, dtype=f32, device=device),
                     "gC": torch.empty(G, dtype=f32, device=device)}
        self.toeplitz: dict[int, Tensor] = {}
        self.exponents: dict[int, tuple[Tensor, Tensor]] = {}
        self.zero = torch.zeros((), dtype=f32, device=device)  # where's `other` (its out= form takes no scalar)

    def take(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """A contiguous view of that shape on the buffer's first elements."""
        n = 1
        for d in shape:
            n *= d
        return self.flat[name][:n].view(shape)

    def powers_of(self, C: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """(k = 0..C as float64, the indices C, C-1, ..., 1): the exponents of gpow, and where
        w[:, i] = g^(C - i) sits in it."""
        if C not in self.exponents:
            self.exponents[C] = (torch.arange(C + 1, dtype=torch.float64, device=device),
                                 torch.arange(C, 0, -1, device=device))
        return self.exponents[C]

    def toeplitz_index(self, C: int, device: torch.device) -> Tensor:
        """[C, C] int64, [j, i] = j + C - 1 - i: where Dt[j, i] = g^(j - i) sits in z (see below)."""
        if C not in self.toeplitz:
            k = torch.arange(C, device=device)
            self.toeplitz[C] = k[:, None] + (C - 1) - k[None, :]
        return self.toeplitz[C]


def _gather_rows(x: Tensor, idx: Tensor, L: int, out: Tensor) -> Tensor:
    """out[:] = x[idx, :L] as float32 (out [G, L] float32, maybe a strided view)."""
    if x.dtype == torch.float32:
        return torch.index_select(x[:, :L], 0, idx, out=out)
    return out.copy_(x[:, :L].index_select(0, idx))  # another dtype: one [G, L] copy in it, then cast


def right_padded_lengths(mask: Tensor) -> Tensor:
    """[B] lengths of a right-padded [B, T] mask; ValueError naming a row with a hole.

    Rows are checked _GROUP at a time in reused buffers: no [B, T] temporary."""
    B, T = mask.shape
    lengths = torch.empty(B, 1, dtype=torch.int64, device=mask.device)
    rows = max(1, min(B, _GROUP))  # (1 for B = 0: no block, no empty range step)
    u_buf = None if mask.dtype == torch.bool else torch.empty(rows, T, dtype=torch.bool, device=mask.device)
    step = torch.empty(rows, max(T - 1, 0), dtype=torch.uint8, device=mask.device)
    flipped = torch.empty(rows, T, dtype=torch.uint8, device=mask.device)
    ones = torch.ones(rows, 1, dtype=torch.uint8, device=mask.device)
    for s in range(0, B, rows):
        block = mask[s : s + rows]
        n = block.shape[0]
        if u_buf is not None:
            block = torch.ne(block, 0, out=u_buf[:n])
        u = block.view(torch.uint8)
        if T > 1:
            # Consecutive differences are 0 or 255 (1 -> 0) on a right-padded row; 1 marks 0 -> 1.
            d = torch.sub(u[:, 1:], u[:, :-1], out=step[:n])
            if int(d.add_(1).amax()) == 2:
                bad = s + int((d == 2).any(1).nonzero()[0])
                raise ValueError(
                    f"masks must be right-padded (1s then 0s per row); row {bad} has a 0 before a 1"
                )
        # Each row of 1 - u is sorted (0s then 1s): the first 1 is at the row's length.
        torch.searchsorted(torch.bitwise_xor(u, 1, out=flipped[:n]), ones[:n], out=lengths[s : s + n])
    return lengths.squeeze(1)


def _discounted_reverse_cumsum(delta: Tensor, g: Tensor, C: int, work: _Workspace) -> Tensor:
    """A_t = sum_{k>=0} g^k delta_{t+k} per row; delta [G, P] float32 (P = n C, zero past each
    row's end), g [G] float64 in [0, 1]. Returns [G, P], a view of work's "adv" buffer."""
    G, P = delta.shape
    n = P // C
    device = delta.device
    # Powers in float64, then float32: g^k for k = 0..C. (0^0 = 1 keeps g = 0 exact.)
    k, reversed_k = work.powers_of(C, device)
    gpow = torch.pow(g[:, None], k[None, :], out=work.take("gpow", (G, C + 1)))  # [G, C+1]
    # Dt[b, j, i] = g_b^(j - i) for j >= i, else 0, so that delta_chunk[b, c, :] @ Dt[b] is the
    # within-chunk part of A at every position i of chunk c. Read from z[b, m] = g_b^(m - (C-1))
    # (0 for m < C-1) at m = j + C-1 - i: a Toeplitz matrix, gathered into the workspace.
    z = work.take("z", (G, 2 * C - 1))  # [G, 2C-1]
    z[:, : C - 1].zero_()
    z[:, C - 1 :].copy_(gpow[:, :C])  # float64 -> float32, as .to(torch.float32) rounds
    Dt = work.take("dt", (G, C, C))
    torch.gather(z[:, None, :].expand(G, C, 2 * C - 1), 2, work.toeplitz_index(C, device).expand(G, C, C), out=Dt)
    adv = torch.bmm(delta.view(G, n, C), Dt, out=work.take("adv", (G, n, C)))  # [G, n, C]
    if n > 1:
        # Link the chunks backwards: carry[:, c] = A at the first position of chunk c+1, written
        # in place: carry[:, c] = heads[:, c+1] + g^C * carry[:, c+1], no tensor per step.
        gC = work.take("gC", (G,)).copy_(gpow[:, C])  # [G] float32
        heads = adv[:, :, 0]  # [G, n] (view): local A at each chunk's first position
        carry = work.take("carry", (G, n))
        carry[:, n - 1].zero_()
        carry[:, n - 2].copy_(heads[:, n - 1])
        for c in range(n - 3, -1, -1):
            torch.addcmul(heads[:, c + 1], gC, carry[:, c + 1], out=carry[:, c])
        # A_t += g^(C - i) * carry, one batched rank-1 update; w[b, i] = g_b^(C - i).
        w64 = torch.index_select(gpow, 1, reversed_k, out=work.take("w64", (G, C)))
        w = work.take("w", (G, C)).copy_(w64)  # [G, C] float32
        adv.baddbmm_(carry.unsqueeze(2), w.unsqueeze(1))
    return adv.view(G, P)
