"""Rollout batches as tensors, and the two coordinate systems the trainer uses.

Sequence layout ("seq", what the model sees): prompt then response, contiguous, right-padded:
    tokens[b, :P_b] = prompt, tokens[b, P_b : P_b + R_b] = response, then pad.
The model's output at position p predicts token p + 1, so response token t (0-based) is
predicted at position P_b - 1 + t. Every per-token quantity of a response (log-probs, values
V_t, advantages, returns) lives at these "prediction positions", marked by `mask`:
    mask[b, p] = 1  for  P_b - 1 <= p < P_b - 1 + R_b                         [B, S]
This is also where VAPO's V_t sits: "the critic's output at the position that predicts a_t".

Response layout ("resp", what GAE sees): [B, T], response token t at column t, right-padded.
`to_response` / `to_sequence` move between the two with one gather/scatter.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class RolloutBatch:
    """One rank's sequences. Tensors are [B, S] (seq layout) unless noted."""

    tokens: torch.Tensor          # [B, S] int64, pad = 0
    prompt_lens: torch.Tensor     # [B] int64
    response_lens: torch.Tensor   # [B] int64
    rewards: torch.Tensor         # [B] float32, the verifier's score of each response
    correct: torch.Tensor         # [B] bool
    group_ids: torch.Tensor       # [B] int64, index of the prompt each response answers
    # Filled in by the step: all [B, S] float32 at prediction positions (zero elsewhere).
    old_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    # Routing replay (data/routes.py): [B, S, moe_layers, k] small ints, the experts the engine
    # routed the token at each position to (placeholders where it routed none); None without replay.
    routes: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def mask(self) -> torch.Tensor:
        return prediction_mask(self.prompt_lens, self.response_lens, self.tokens.shape[1])

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prompt_lens + self.response_lens

    def select(self, index: list[int] | torch.Tensor) -> "RolloutBatch":
        """Rows `index`, trimmed to their longest sequence (a micro- or mini-batch)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        width = int(self.seq_lens[idx].max()) if len(idx) else 1

        def take(x):
            if x is None:
                return None
            return x[idx, :width] if x.dim() == 2 else x[idx]

        return replace(
            self,
            tokens=take(self.tokens), prompt_lens=take(self.prompt_lens),
            response_lens=take(self.response_lens), rewards=take(self.rewards),
            correct=take(self.correct), group_ids=take(self.group_ids),
            old_logp=take(self.old_logp), values=take(self.values),
            advantages=take(self.advantages), returns=take(self.returns),
            routes=None if self.routes is None else self.routes[idx, :width],
            extras={k: take(v) if isinstance(v, torch.Tensor) else [v[i] for i in idx.tolist()]
                    for k, v in self.extras.items()},
        )


def prediction_mask(prompt_lens: torch.Tensor, response_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] float mask of the positions that predict response tokens."""
    pos = torch.arange(width).unsqueeze(0)
    start = (prompt_lens - 1).unsqueeze(1)
    return ((pos >= start) & (pos < start + response_lens.unsqueeze(1))).float()


def pack_sequences(prompts: list[list[int]], responses: list[list[int]],
                   pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded [B, S] tokens, prompt lengths [B], response lengths [B]."""
    lens = [len(p) + len(r) for p, r in zip(prompts, responses)]
    tokens = torch.full((len(prompts), max(lens)), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        tokens[i, : lens[i]] = torch.tensor(p + r, dtype=torch.long)
    return (
        tokens,
        torch.tensor([len(p) for p in prompts], dtype=torch.long),
        torch.tensor([len(r) for r in responses], dtype=torch.long),
    )


def _response_index(prompt_lens: torch.Tensor, width_resp: int, width_seq: int) -> torch.Tensor:
    idx = (prompt_lens - 1).unsqueeze(1) + torch.arange(width_resp).unsqueeze(0)
    return idx.clamp(max=width_seq - 1)


def to_response(x: torch.Tensor, prompt_lens: torch.Tensor, response_lens: torch.Tensor) -> torch.Tensor:
    """[B, S] seq layout -> [B, T] response layout (T = longest response); zero on padding."""
    width = max(int(response_lens.max()), 1)
    out = x.gather(1, _response_index(prompt_lens, width, x.shape[1]))
    valid = torch.arange(width).unsqueeze(0) < response_lens.unsqueeze(1)
    return out * valid


def to_sequence(y: torch.Tensor, prompt_lens: torch.Tensor, response_lens: torch.Tensor,
                width_seq: int) -> torch.Tensor:
    """[B, T] response layout -> [B, S] seq layout; zero outside prediction positions."""
    valid = (torch.arange(y.shape[1]).unsqueeze(0) < response_lens.unsqueeze(1))
    out = torch.zeros(y.shape[0], width_seq + y.shape[1], dtype=y.dtype)
    out.scatter_(1, (prompt_lens - 1).unsqueeze(1) + torch.arange(y.shape[1]).unsqueeze(0), y * valid)
    return out[:, :width_seq]


def cat_rows(batches: list["RolloutBatch"]) -> "RolloutBatch":
    """The batches' rows in order, as one batch: [B, S] tensors right-padded with zeros to the
    widest (padding no mask reads). Fields that are None in every batch stay None; extras are not
    carried (the critic's rows need none: mcore/critic_share.py)."""
    width = max(int(b.tokens.shape[1]) for b in batches)

    def cat(name):
        parts = [getattr(b, name) for b in batches]
        if all(x is None for x in parts):
            return None
        if any(x is None for x in parts):
            raise ValueError(f"cat_rows: {name} is set in some batches only")
        if parts[0].dim() == 1:
            return torch.cat(parts)
        return torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1])) if x.dim() == 2 else
                          torch.nn.functional.pad(x, (0, 0, 0, 0, 0, width - x.shape[1])) for x in parts])

    names = ("tokens", "prompt_lens", "response_lens", "rewards", "correct", "group_ids", "old_logp", "values",
             "advantages", "returns", "routes")
    return RolloutBatch(**{n: cat(n) for n in names})


def shifted_targets(tokens: torch.Tensor) -> torch.Tensor:
    """targets[b, p] = tokens[b, p + 1] (the last column gets pad 0; it is never masked in)."""
    return torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)


def pad_ragged(rows: list[list[float]]) -> torch.Tensor:
    """[B, T] float32 from ragged per-response lists (response layout), zero-padded."""
    out = torch.zeros(len(rows), max((len(r) for r in rows), default=1) or 1)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out
