"""Whole commands end to end: vapo-train, vapo-eval, vapo-convert under torchrun and on local Slurm
clusters. Runs whose subject is what the trainer computes (resumes, layouts, families, baselines)
fork their ranks from a preloaded server instead (tests/helpers/train_runs.py, train_in_forks):
the same vapo_megatron.train.main, without three fresh interpreters' imports."""
