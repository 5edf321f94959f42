import os
import sys

# Helpers (dist_utils, tiny model builders) live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))
# Keep torch's intra-op threads from oversubscribing the 2-core CI machine in multi-rank tests.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from slurm_cluster import session_lock  # noqa: E402


@pytest.fixture(scope="session")
def slurm_lock():
    """One local Slurm cluster user per machine at a time (tests/slurm_cluster.py); held until the
    session ends, since the cluster fixtures stop their clusters then."""
    lock = session_lock()
    yield
    lock.close()
