"""vapo-megatron: VAPO (value-model-based augmented PPO) on Megatron-Core, with colocated SGLang
rollouts. The commands are train.py, convert.py, eval.py, plan.py and check.py (vapo-check, whose
checks are nodecheck/); docs/architecture.md maps the folders, docs/algorithm.md the algorithm."""
