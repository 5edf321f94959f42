"""What every layer of the package may use, importing nothing of the package itself: the bottom
layer (docs/architecture.md, "The tree").

    atomic.py        the one atomic/fsync helper every writer of the project uses (checkpoints,
                     exports, metrics, eval outputs, the run's config.yaml), and the rule that a
                     writer replaces only directories it wrote (the .vapo-writer marker)
    machine.py       the CPU kind a process runs on (learning studies' and golden records' key)
    fault_points.py  the named boundaries (generator, optimizer step, checkpoint manager) where a
                     test may kill or poison a run (no-ops unless the tests' entry point installs its hook)
"""
