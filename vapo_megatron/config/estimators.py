"""What each advantage estimator is, as a record the whole package asks (algo.estimator).

Every "does this run have a critic?" question -- the trainer's critic role, the config checks,
vapo-plan, its layout search and report, the finished-run check -- is asked of the record, never
of the estimator's name. The estimators' math is in algorithms/advantages.py (ADVANTAGE_FNS, keyed
by the same names; the suite checks the two agree). Pure Python: the config
checks run before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Estimator:
    name: str          # algo.estimator's value
    needs_critic: bool  # a value model is built, pretrained, checkpointed, offloaded and sized
    min_group: int     # the smallest rollout.n_samples at which it gives any advantage
    keys: tuple[str, ...]  # the algo.* settings it reads beyond the losses' (docs/config.md)
    summary: str       # one line, for messages and docs


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("gae", needs_critic=True, min_group=1,
              keys=("algo.gamma", "algo.lambda_critic", "algo.lambda_policy", "algo.decoupled_gae",
                    "algo.length_adaptive", "algo.alpha"),
              summary="VAPO/PPO: decoupled, length-adaptive GAE on a learned critic's values"),
    Estimator("grpo", needs_critic=False, min_group=2, keys=("algo.grpo_std_norm", "algo.grpo_std_eps"),
              summary="GRPO/DAPO: reward minus its group's mean, over the group's std; no critic"),
    # REINFORCE++'s global advantage normalization (Hu et al. 2025, arXiv 2501.03262) without its KL
    # term: the step's whole batch, over every DP rank, is the baseline, so a group of one answer
    # still gets an advantage (the value-free arm of one answer per prompt).
    Estimator("batch", needs_critic=False, min_group=1, keys=("algo.batch_std_eps",),
              summary="reward minus the step's batch mean (all DP ranks), over the batch's std; no critic"),
)}


def estimator_of(cfg) -> Estimator:
    """The record of cfg.algo.estimator (the schema's Literal admits only its names)."""
    return ESTIMATORS[cfg.algo.estimator]
