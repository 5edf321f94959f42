"""The synthetic tasks: data, tokenizer and tiny random-init model that `make demo`, the chain-task
studies and vapo-check's training steps run on. Product code, not test machinery; it imports nothing
of the package, so any layer may use it (docs/architecture.md).

    demo_task.py  the demo's synthetic task, tokenizer and tiny random-init model
    chain_task.py the chain task: worked sums of 2-10 terms, answers of 7-80 tokens, terminal reward
"""
