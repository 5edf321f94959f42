"""Step 5 of the loop (pure tensors): advantages, and the critic's value targets, of a batch.

An estimator is a function of the batch, named by its record in config/estimators.py (which also
says whether it needs a critic, its settings and its smallest group):
    gae    VAPO/PPO, from rewards and the critic's values (below)
    grpo   value-free (GRPO, DAPO): reward minus the group's mean, over the group's std
    batch  value-free: reward minus the mean of the step's whole batch, over its std
Each takes the batch, the settings and `dp_sum` (an in-place sum over the data-parallel group of a
float64 tensor: the one collective a global statistic needs) and returns (advantages [B, S],
returns [B, S] or None, logs).

Decoupled GAE (VAPO component 2): returns use lambda_critic (1.0: Monte-Carlo returns, so the
value target is unbiased however long the response), advantages use lambda_policy.
Length-adaptive GAE (component 3): lambda_policy_i = 1 - 1/(alpha * |o_i|), so a long response
does not see its terminal reward discounted away by (lambda)^|o|.
Reward is 0 on every token but the last, gamma = 1 (sec. 2, token-level MDP).
"""

from __future__ import annotations

from typing import Callable

import torch

from vapo_megatron.algorithms.gae import compute_gae, length_adaptive_lambda
from vapo_megatron.config import AlgoConfig
from vapo_megatron.data.batch import RolloutBatch, to_response, to_sequence


def policy_lambdas(response_lens: torch.Tensor, algo: AlgoConfig) -> torch.Tensor:
    """[B] lambda_policy per response."""
    if algo.length_adaptive:
        return length_adaptive_lambda(response_lens.float(), algo.alpha)
    return torch.full((len(response_lens),), algo.lambda_policy)


def compute_advantages(batch: RolloutBatch, algo: AlgoConfig, *,
                       value_pretrain: bool) -> tuple[torch.Tensor, torch.Tensor]:
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


def group_relative_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, std_norm: bool,
                              eps: float) -> torch.Tensor:
    """[B] GRPO advantages: (r_i - mean of i's group) / (std of i's group + eps), or without the
    division when std_norm is False (Dr. GRPO). rewards [B], group_ids [B] (any integer labels;
    the samples of one prompt share one). The std is the sample standard deviation (Bessel's
    n - 1, as torch.std); a group of one has advantage 0 (nothing to compare it with), and a group
    whose rewards are all equal has advantage 0 on every sample."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be one [B] shape")
    r = rewards.to(torch.float64)
    _, ids = torch.unique(group_ids, return_inverse=True)  # [B] in 0..G-1
    G = int(ids.max()) + 1 if len(ids) else 0
    count = torch.zeros(G, dtype=torch.float64).index_add_(0, ids, torch.ones_like(r))
    mean = torch.zeros(G, dtype=torch.float64).index_add_(0, ids, r) / count
    dev = r - mean[ids]
    if not std_norm:
        return dev.float()
    var = torch.zeros(G, dtype=torch.float64).index_add_(0, ids, dev * dev) / (count - 1).clamp(min=1)
    return (dev / (var.sqrt()[ids] + eps)).float()


def informative_groups(scores: list[float], group_of: list[int], groups: int) -> list[bool]:
    """[groups] True where a group's scores are not all equal. scores[i] belongs to group
    group_of[i]; a group with one sample (or none) is never informative. The others have advantage
    0 on every sample (above): DAPO's dynamic sampling drops them (rollout/dynamic_sampling.py,
    rollout/partial.py)."""
    seen: list[set] = [set() for _ in range(groups)]
    for score, g in zip(scores, group_of):
        seen[g].add(score)
    return [len(s) > 1 for s in seen]


def batch_relative_advantages(rewards: torch.Tensor, dp_sum: Callable[[torch.Tensor], torch.Tensor], *,
                              eps: float) -> tuple[torch.Tensor, float, float]:
    """([B] advantages, mean, std): (r_i - mean) / (std + eps) with the mean and the sample std
    (Bessel's n - 1, as torch.std) of every response of the step, on every DP rank: one
    all-reduce of (n, sum r, sum r^2) in float64. A step of one response has advantage 0, as has a
    step whose rewards are all equal. REINFORCE++'s global normalization (arXiv 2501.03262)."""
    r = rewards.to(torch.float64)
    n, total, sq = dp_sum(torch.stack([torch.tensor(float(len(r)), dtype=torch.float64),
                                       r.sum(), (r * r).sum()])).tolist()
    mean = total / max(n, 1.0)
    var = max(sq - n * mean * mean, 0.0) / max(n - 1.0, 1.0)
    return ((r - mean) / (var ** 0.5 + eps)).float(), mean, var ** 0.5


def gae_estimator(batch: RolloutBatch, algo: AlgoConfig, *, value_pretrain: bool, dp_sum):
    """VAPO's estimator: decoupled, length-adaptive GAE on the critic's values."""
    advantages, returns = compute_advantages(batch, algo, value_pretrain=value_pretrain)
    return advantages, returns, {"actor/lambda_policy_mean": float(policy_lambdas(batch.response_lens, algo).mean())}


def grpo_estimator(batch: RolloutBatch, algo: AlgoConfig, *, value_pretrain: bool, dp_sum):
    """GRPO's estimator: one group-relative value on every token of a response; no value targets.
    Groups never straddle DP ranks (whole groups are dealt to ranks), so the statistics are exact."""
    per_response = group_relative_advantages(batch.rewards, batch.group_ids, std_norm=algo.grpo_std_norm,
                                             eps=algo.grpo_std_eps)                    # [B]
    return per_response.unsqueeze(1) * batch.mask, None, {}


def batch_estimator(batch: RolloutBatch, algo: AlgoConfig, *, value_pretrain: bool, dp_sum):
    """The batch-mean baseline: one value on every token of a response, the step's global reward
    statistics as baseline and scale; no value targets. Exact over DP ranks through dp_sum."""
    per_response, mean, std = batch_relative_advantages(batch.rewards, dp_sum, eps=algo.batch_std_eps)  # [B]
    return (per_response.unsqueeze(1) * batch.mask, None,
            {"actor/batch_reward_mean": mean, "actor/batch_reward_std": std})

