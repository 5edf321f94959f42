"""Routers for routing-replay tests, on transformers' Qwen3-MoE (Qwen3MoeTopKRouter):

- near_tie(model): experts 0, 1 and 2 of every router get almost the same weight row, so nearly
  every token's top-2 boundary falls between near-tied scores;
- bf16_selection(model): the engine's router picks its top-k from bfloat16-rounded scores (as a
  bf16 rollout kernel would) and weighs the chosen experts with float32 scores; with near ties it
  picks other experts than a float32 router for some tokens, and replaying its picks reproduces it
  exactly;
- forced(model, routes): a reference that routes token (b, s) of layer column c to routes[b, s, c]
  (a batch's [B, S, moe_layers, k]), weights as transformers computes them (norm_topk_prob).
"""

from __future__ import annotations

import types

import torch


def _routers(model) -> list:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]


def near_tie(model, *, spread: float = 3e-4, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in _routers(model):
            base = router.weight[0].clone()
            for e in (1, 2):
                router.weight[e] = base + spread * torch.randn(base.shape, generator=gen)


def _weights(logits: torch.Tensor, indices: torch.Tensor, norm: bool) -> torch.Tensor:
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.gather(-1, indices)
    return (top / top.sum(-1, keepdim=True) if norm else top).to(logits.dtype)


def bf16_selection(model) -> None:
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        picked = torch.topk(torch.softmax(logits.float(), -1).bfloat16(), self.top_k, dim=-1).indices
        return logits, _weights(logits, picked, self.norm_topk_prob), picked

    for router in _routers(model):
        router.forward = types.MethodType(forward, router)


def forced(model, routes: torch.Tensor) -> None:
    """Route every call's tokens (a [B, S] batch, flattened batch-major as transformers does) by `routes`."""
    for column, router in enumerate(_routers(model)):
        def forward(self, hidden_states, _column=column):
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            logits = torch.nn.functional.linear(hidden_states, self.weight)
            picked = routes[:, :, _column].reshape(-1, routes.shape[-1]).long()
            return logits, _weights(logits, picked, self.norm_topk_prob), picked

        router.forward = types.MethodType(forward, router)
