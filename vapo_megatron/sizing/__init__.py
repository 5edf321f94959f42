"""vapo-plan's sizing: will a run fit on its GPUs? (vapo_megatron/plan.py is the command.)

    shards.py   each distinct rank's actor and critic shard (no critic under algo.estimator=grpo), on the meta device
    memory.py   bytes per rank: parameters, gradients, optimizer state, activations, the reserve
    plan.py     the two phases of a colocated run (training, rollout) per rank, and what does not fit
    report.py   the printed table
"""
