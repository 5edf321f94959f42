"""Rollout: the engines that sample responses, and the weight sync that keeps them on the newest actor.

    generator.py      what the loop calls: engines of this replica, generate/collect, release, sync
    dynamic_sampling.py  a step's prompts and rollouts: one round, or DAPO's dynamic sampling
    partial.py        partial rollout: bounded generation per step, groups carried over (data/carry_over.py)
    base.py           the one interface every engine implements (RolloutEngine, SamplingParams)
    engines.py        each engine's record: how it is built, what GPU memory it takes (config/engines.py: its facts)
    embedded.py       transformers in this process (the CPU engine; also a single GPU)
    sglang_engine.py  colocated sglang.Engine per block of a TP group (GPU); sglang_http.py: a server;
                      sglang_requests.py: the requests they send and the answers they read
    weight_sync.py    Megatron shards -> full HF tensors -> engines, bounded memory
    tp_gather.py      TP shards to the ranks that need full tensors (shared memory or collectives)
    buckets.py        flat single-dtype weight buckets
"""
