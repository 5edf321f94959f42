"""vapo-check's checks (vapo_megatron/check.py runs them; its docstring says what each proves).

    models.py      what every check shares (Env, report) and the model checks: model_logits,
                   recompute, weight_sync and the real SGLang engine's engine_memory, sync_memory,
                   engine_signals
    runtime.py     collectives, wait_groups, wgrad_fusion, vocab_parallel
    replay.py      routing_replay (MoE presets)
    offload.py     offload, offload_memory
    checkpoint.py  adam_resume, save_before_update (also run by the suite on the CPU)
    steps.py       vapo_steps, phase_memory, plan_memory
    ranks_mode.py  vapo-check --ranks (under torchrun, one rank per GPU): each preset's model, its engines
    multi_rank.py  --ranks' checks on running SGLang engines: sglang_sync, routed_experts (also run by
                   the suite on SGLang's CPU engines)
"""
