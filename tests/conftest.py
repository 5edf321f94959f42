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


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A tiny demo directory (data, tokenizer, Qwen2 model: 4 heads, 2 KV heads, 2 layers, FFN 256,
    context 128) for tests that start the trainer on the CLI; one per test module."""
    from vapo_megatron.data.synthetic import TinyModelSpec, write_demo_dir

    out = tmp_path_factory.mktemp("demo") / "data"
    write_demo_dir(str(out), seed=0, task="add", n_train=64, n_eval=8, n_sft=16, sft_noise=0.0, spec=TinyModelSpec())
    return out
