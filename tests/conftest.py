import os
import sys

# Keep torch's intra-op threads from oversubscribing the 2-core CI machine in multi-rank tests.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from tests.helpers import early_pip  # noqa: E402
from tests.helpers.slurm_cluster import session_lock  # noqa: E402

# Session fixtures of the two Slurm files: the one-node cluster and its reference job, run once.
from tests.helpers.slurm_demo import slurm_demo_data, slurm_env, uninterrupted  # noqa: E402,F401

# `make test` runs the suite on two pytest-xdist workers (-n 2 --dist loadfile): about half the
# suite's time is spent waiting (Slurm scheduling, signals, subprocess start-up) with one core idle.
# Each file's tests stay on one worker, so its module fixtures (reference runs) are built once, and
# the two Slurm files are one unit of work: they hold the machine's one Slurm lock (slurm_lock)
# until their worker ends. (xdist's own `xdist_group` marks cannot do this under pytest 9: xdist
# 3.8 renames node ids through an attribute pytest 9 no longer reads.)
SLURM_FILES = {"test_slurm.py", "test_slurm_multinode.py"}
# The order files are handed out in: longest work first, so that the suite's end is short files on
# both workers, not one worker alone on a 3-minute end-to-end file. xdist's own order (files with
# the most tests first) ran the one-test end-to-end files last; on the 2-core machine that left a
# worker idle for minutes. Tiers, not measured seconds: the Slurm files wait on the scheduler for
# minutes, an e2e file launches whole runs, a distributed file forks ranks, a unit file is quick.
TIERS = ("slurm", "e2e", "distributed", "unit")


def _tier(path: str) -> int:
    if os.path.basename(path) in SLURM_FILES:
        return 0
    parts = path.replace(os.sep, "/").split("/")
    return next((TIERS.index(p) for p in parts if p in TIERS[1:]), len(TIERS))


def pytest_configure(config):
    early_pip.start(config)  # the GPU install's pip resolution, waiting on the index from the start


def pytest_unconfigure(config):
    early_pip.stop(config)


def pytest_collection_modifyitems(config, items):
    """Longest tier first (stable: files keep their order within a tier)."""
    items.sort(key=lambda item: _tier(item.nodeid.split("::", 1)[0]))


@pytest.hookimpl(optionalhook=True)  # a bare `pytest` without xdist installed still runs
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the collection's order (TIERS above), not xdist's

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "slurm" if os.path.basename(path) in SLURM_FILES else path

    return FileScheduling(config, log)


@pytest.fixture(scope="session")
def slurm_lock():
    """One local Slurm cluster user per machine at a time (tests/helpers/slurm_cluster.py); held until the
    session ends, since the cluster fixtures stop their clusters then."""
    lock = session_lock()
    yield
    lock.close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A tiny demo directory (data, tokenizer, Qwen2 model: 4 heads, 2 KV heads, 2 layers, FFN 256,
    context 128) for tests that start the trainer on the CLI; one per test module."""
    from vapo_megatron.tasks.demo_task import TinyModelSpec, write_demo_dir

    out = tmp_path_factory.mktemp("demo") / "data"
    write_demo_dir(str(out), seed=0, task="add", n_train=64, n_eval=8, n_sft=16, sft_noise=0.0, spec=TinyModelSpec())
    return out


# The library worlds' stand-ins (tests/helpers/worlds.py) run only in a world's own interpreter; the
# suite's process is the local world, whatever ran in it before (one process or two xdist workers,
# any file order). A test that imports a stand-in here, or puts one on sys.path, fails at its own
# teardown, naming what it left (not a later test that happens to look, as test_te_doubles.py's
# test_the_local_world_has_no_transformer_engine would).
WORLD_DOUBLES = tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), "doubles", world) + os.sep
                      for world in ("te", "apex"))
# The names the stand-ins are imported by (their libraries' own: transformer_engine, apex, amp_C, ...).
DOUBLE_NAMES = sorted({entry.removesuffix(".py") for folder in WORLD_DOUBLES for entry in os.listdir(folder)
                       if not entry.startswith(("_", "."))})


def doubles_here() -> list[str]:
    """The stand-ins imported in this process under their libraries' names, and sys.path entries
    into tests/doubles/te or apex (through which megatron-core would import them)."""
    modules = [name for name in DOUBLE_NAMES
               if (getattr(sys.modules.get(name), "__file__", None) or "").startswith(WORLD_DOUBLES)]
    paths = [p for p in sys.path if os.path.join(os.path.abspath(p or "."), "").startswith(WORLD_DOUBLES)]
    return modules + [f"sys.path entry {p}" for p in paths]


_REPORTED: set[str] = set()  # each leak fails the test that made it, not every test after it


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    leaked = [x for x in doubles_here() if x not in _REPORTED]
    _REPORTED.update(leaked)
    if leaked:
        raise RuntimeError(f"{item.nodeid} left test doubles of another world in the suite's process "
                           f"(tests/helpers/worlds.py runs them in their own interpreter): {leaked[:10]}")
