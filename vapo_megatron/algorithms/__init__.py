"""VAPO's math as pure functions of tensors (docs/algorithm.md; arXiv 2504.05118).

    gae.py            GAE, length-adaptive lambda (components 2, 3)
    advantages.py     step 5: the estimators, GAE (decoupled returns and advantages) and GRPO;
                      which groups carry a signal at all (dynamic sampling's rule)
    losses.py         PPO with clip-higher, positive-example NLL, value loss: SUMS over tokens
    off_policy.py     partial rollout's staleness and truncated importance weights (decoupled PPO)
    normalization.py  the global counts N, N_pos, M a mini-batch's loss sums are divided by
    step_stats.py     a step's figures over every DP rank (means, whitening, explained variance,
                      off-policy weights), each handed the reduction it needs
"""
