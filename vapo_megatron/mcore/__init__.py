"""Megatron-Core as this trainer uses it: process groups, models, optimizer, schedule, the two roles.

    parallel.py      distributed start-up, every process group and collective (the only user of
                     megatron's parallel_state); cpu_compat.py lets megatron run on gloo;
                     nccl_env.py: the NCCL settings every rank shares (set before the groups)
    models.py        megatron models from a family's Architecture; every TransformerConfig field
                     (critic_model.py: the value-head model; sp_norm.py: RMSNorm for sequence parallel)
    model.py         TrainModel: chunks + DDP + optimizer + LR schedule; how parallelism is applied
    optimizer.py     megatron's optimizer, OptimizerParamScheduler, the NaN-guarded step
    schedule.py      one call of megatron's pipeline schedule; why the loss scaling is exactly global
    update.py        the mini-batch / optimizer-step loop shared by both roles
    moe_metrics.py   the router's load-balancing loss read back for the logs (MoE models)
    routing_replay.py  the actor's MoE routers take the rollout engine's routes (R3)
    actor.py         the policy: old log-probs, PPO + positive-example NLL update
    vocab_parallel.py  log-probs and entropy from vocabulary-sharded logits (TP)
    critic.py        the value model: values, clipped value-loss update
    dp_stats.py      the reductions over the data-parallel group a step's figures are handed
    memory.py        GPU memory handed back at the trainer <-> rollout-engine phase switches
    offload.py       the trainer's state in host memory during rollout (trainer.offload_during_rollout)
    dtypes.py        parameter dtypes by name
    megatron_import.py  megatron-core imported without torch.compile where no GPU is visible
"""
