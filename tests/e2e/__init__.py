"""Whole commands end to end: vapo-train, vapo-eval, vapo-convert under torchrun and on local Slurm clusters."""
