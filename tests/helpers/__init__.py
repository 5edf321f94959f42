"""Helpers shared by the tests: spawning gloo ranks, launching the trainer, tiny HF models, ports,
the local Slurm cluster, SGLang's source read with ast, reward functions that misbehave, and what
a quiet command must not print."""
