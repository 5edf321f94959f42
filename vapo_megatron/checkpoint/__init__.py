"""Checkpoints: the run's checkpoint manager, megatron dist-checkpoint I/O, and safe loading.

    manager.py        run_dir/checkpoints: save, resume, fall back past a damaged checkpoint
    model_state.py    one model in a checkpoint: weights and optimizer state (either Adam layout),
                      read in the format the checkpoint records
    optimizer_state.py  the distributed optimizer's state: each rank writes and reads its own share
    dist_io.py        megatron dist checkpoints of model chunks (and vapo-convert's streaming save);
                      check_storage: every storage file whole, before any command reads one
    complete.py       which of a run's checkpoints is whole and whether the run finished, from its files
    lazy_save.py      a dist-checkpoint save whose tensors are made one at a time (hf-to-mcore)
    run_state.py      RunState: the loop's counters, the prompt sampler's position and the carry-over
                      buffer, as state.json holds them
    safe_unpickle.py  no checkpoint file can run code when loaded

Every file is written through runtime/atomic.py.
"""
