"""The training loop and what runs around it.

    trainer.py     Trainer: the run (warm start, value pretraining, VAPO steps, evals, saves) and
                   one step that reads top to bottom
    warm_start.py  the optional supervised phase before RL
    signals.py     SIGUSR1/SIGTERM/Ctrl-C, and the collective decision to stop after a step
    run_guard.py   one trainer per run directory (a lock), workers that die with their launcher
    deadline.py    does one more step and a checkpoint fit before the job's end?
    metrics.py     metrics.jsonl, TensorBoard, W&B and the progress bar (rank 0)
    wandb_run.py   Weights & Biases tracking: one W&B run per run directory, each step once
    wandb_records.py  what a W&B run directory holds, read from its transaction logs
    timing.py      perf/<phase>_s of every step
"""
