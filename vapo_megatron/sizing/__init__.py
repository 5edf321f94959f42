"""vapo-plan's sizing: will a run fit on its GPUs? (vapo_megatron/plan.py is the command.)

    shards.py   each distinct rank's actor and critic shard (no critic under algo.estimator=grpo), on the meta device
    memory.py   bytes per rank: parameters, gradients, optimizer state, activations, the reserve
    plan.py     the two phases of a colocated run (training, rollout) per rank, and what does not fit
    report.py   the printed tables
    step_time.py    how long one iteration takes on a named GPU, per phase, and the run's GPU-hours
    step_config.py  its inputs from a run config and vapo-plan's --gpu options
    hardware.py     the GPUs it knows: datasheet rates, the links between GPUs
    flops.py        a model's shapes, parameter count and FLOPs per token
    search.py       --search: every layout the trainer accepts that fits, ranked by step time
    layer_counts.py     its shards for every layout, from a few meta-device builds per (TP, EP)
    search_report.py    its printed ranking
"""
