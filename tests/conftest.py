import os
import sys

# Helpers (dist_utils, tiny model builders) live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))
# Keep torch's intra-op threads from oversubscribing the 2-core CI machine in multi-rank tests.
os.environ.setdefault("OMP_NUM_THREADS", "1")
