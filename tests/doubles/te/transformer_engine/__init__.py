"""Test double of Transformer Engine (TE 2.20.2), pure torch, for the suite's TE world on the CPU.

Only what megatron-core 0.19.2 imports from TE on the paths this project runs, each module citing
the TE file it stands in for (read in NVIDIA/TransformerEngine at 2.20.0.dev0, main, the code the
2.20 releases were cut from). Never shipped: tests/helpers/worlds.py puts tests/doubles/te first
on PYTHONPATH of the processes that run the TE world. FP8, userbuffers, CUDA graphs and context
parallelism are not modelled: their entry points raise NotImplementedError, so a path that would
need them fails instead of passing untested.

Devices: TE refuses CPU tensors ("TransformerEngine needs CUDA"); the double accepts them, since in
this world megatron runs under vapo_megatron/mcore/cpu_compat.py, where CPU tensors stand in for
CUDA ones. Everything else (names, shapes, dtypes, init, state dicts) follows TE.
"""

__version__ = "2.20.2"
