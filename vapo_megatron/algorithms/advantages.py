"""Step 5 of the loop (pure tensors): value targets and advantages from rewards and critic values.

Decoupled GAE (VAPO component 2): returns use lambda_critic (1.0: Monte-Carlo returns, so the
value target is unbiased however long the response), advantages use lambda_policy.
Length-adaptive GAE (component 3): lambda_policy_i = 1 - 1/(alpha * |o_i|), so a long response
does not see its terminal reward discounted away by (lambda)^|o|.
Reward is 0 on every token but the last, gamma = 1 (sec. 2, token-level MDP).
"""

from __future__ import annotations

import torch

from vapo_megatron.algorithms.gae import compute_gae, length_adaptive_lambda
from vapo_megatron.config import AlgoConfig
from vapo_megatron.data.batch import RolloutBatch, to_response, to_sequence


def policy_lambdas(response_lens: torch.Tensor, algo: AlgoConfig) -> torch.Tensor:
    """[B] lambda_policy per response."""
    if algo.length_adaptive:
        return length_adaptive_lambda(response_lens.float(), algo.alpha)
    return torch.full((len(response_lens),), algo.lambda_policy)


def compute_advantages(batch: RolloutBatch, algo: AlgoConfig, *, value_pretrain: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, S] in the sequence layout, zero off the mask.

    During value pretraining (component 1) the targets are Monte-Carlo returns (lambda = 1).
    """
    pl, rl = batch.prompt_lens, batch.response_lens
    values = to_response(batch.values, pl, rl)                                 # [B, T]
    T = values.shape[1]
    mask = (torch.arange(T).unsqueeze(0) < rl.unsqueeze(1)).float()           # [B, T]
    rewards = torch.zeros_like(values)
    rewards.scatter_(1, (rl - 1).clamp(min=0).unsqueeze(1), batch.rewards.float().unsqueeze(1))
    lam_policy = policy_lambdas(rl, algo)
    if value_pretrain:
        lam_critic: float | torch.Tensor = 1.0
    else:
        lam_critic = algo.lambda_critic if algo.decoupled_gae else lam_policy
    _, returns = compute_gae(rewards, values, mask, algo.gamma, lam_critic)
    advantages, _ = compute_gae(rewards, values, mask, algo.gamma, lam_policy)
    S = batch.tokens.shape[1]
    return to_sequence(advantages, pl, rl, S), to_sequence(returns, pl, rl, S)
