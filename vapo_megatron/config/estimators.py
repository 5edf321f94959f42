"""What each advantage estimator is, as a record the whole package asks (algo.estimator).

Every question about an estimator -- its step-5 function, whether the run has a critic (the
trainer's critic role, the config checks, vapo-plan, its layout search and report, the finished-run
check), which algo.* settings it reads, the smallest group it works with -- is asked of its record,
never of its name. Adding one (RLOO, say) is its function (the built-ins are in
algorithms/advantages.py) and its record here, or `register(Estimator(...))` from a user's module.

The record names its function as "module:function" (as reward.fn names a reward), imported when
the trainer starts: the config checks read the records before torch is imported, and config/ sits
below algorithms/ in the layers, so it holds no reference to the function itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Estimator:
    name: str          # algo.estimator's value
    needs_critic: bool  # a value model is built, pretrained, checkpointed, offloaded and sized
    min_group: int     # the smallest rollout.n_samples at which it gives any advantage
    keys: tuple[str, ...]  # the algo.* settings it reads beyond the losses' (docs/config.md)
    summary: str       # one line, for messages and docs
    # Its step-5 function, "module:function": f(batch, algo, *, value_pretrain, dp_sum) ->
    # (advantages [B, S], returns [B, S] or None, logs); returns are the critic's targets.
    fn: str = ""

    def function(self) -> Callable:
        """The estimator's function, imported (the trainer asks it once, at start)."""
        module, _, name = self.fn.partition(":")
        return getattr(importlib.import_module(module), name)


_BUILT_IN = "vapo_megatron.algorithms.advantages"

ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("gae", needs_critic=True, min_group=1,
              keys=("algo.gamma", "algo.lambda_critic", "algo.lambda_policy", "algo.decoupled_gae",
                    "algo.length_adaptive", "algo.alpha"),
              summary="VAPO/PPO: decoupled, length-adaptive GAE on a learned critic's values",
              fn=f"{_BUILT_IN}:gae_estimator"),
    Estimator("grpo", needs_critic=False, min_group=2, keys=("algo.grpo_std_norm", "algo.grpo_std_eps"),
              summary="GRPO/DAPO: reward minus its group's mean, over the group's std; no critic",
              fn=f"{_BUILT_IN}:grpo_estimator"),
    # REINFORCE++'s global advantage normalization (Hu et al. 2025, arXiv 2501.03262) without its KL
    # term: the step's whole batch, over every DP rank, is the baseline, so a group of one answer
    # still gets an advantage (the value-free arm of one answer per prompt).
    Estimator("batch", needs_critic=False, min_group=1, keys=("algo.batch_std_eps",),
              summary="reward minus the step's batch mean (all DP ranks), over the batch's std; no critic",
              fn=f"{_BUILT_IN}:batch_estimator"),
)}


def register(estimator: Estimator) -> None:
    """Add an estimator (a user's module, or a test's); a name already taken is refused."""
    if estimator.name in ESTIMATORS:
        raise ValueError(f"algo.estimator {estimator.name!r} is already registered")
    if estimator.fn.count(":") != 1:
        raise ValueError(f"estimator {estimator.name!r}: fn={estimator.fn!r} must be 'module:function'")
    ESTIMATORS[estimator.name] = estimator


def unknown_estimator(name: str) -> str | None:
    """The config problem of an algo.estimator no record has, else None."""
    if name in ESTIMATORS:
        return None
    return f"algo.estimator={name!r} is not an estimator; one of: {', '.join(ESTIMATORS)} (config/estimators.py)"


def estimator_of(cfg) -> Estimator:
    """The record of cfg.algo.estimator (ValueError naming the key for a name no record has)."""
    problem = unknown_estimator(cfg.algo.estimator)
    if problem:
        raise ValueError(problem)
    return ESTIMATORS[cfg.algo.estimator]
