"""What a trainer rank pays to start: the CPU time of importing the trainer's modules in a fresh
interpreter, with megatron-core imported through vapo_megatron/mcore/megatron_import.py (no
torch.compile at import without CUDA; what the commands do) and with a plain `import
megatron.core` (megatron's jit_fuser = torch.compile), and the commands' full start-up (also
config/package_index.py's packages_distributions for transformers' import), side by side,
alternating, in one run.

    python -m benchmarks.startup [--repeats 3]

Prints each way's median CPU seconds (user + system of the child) and its ratio to the plain import. On a machine
with CUDA both ways are the same import (the GPU keeps megatron's compiled fusions).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = "import vapo_megatron.trainer.trainer, vapo_megatron.mcore.parallel, transformers"
WAYS = {
    "plain import megatron.core": f"import megatron.core; {MODULES}",
    "import_megatron()": "from vapo_megatron.mcore.megatron_import import import_megatron; import_megatron(); "
                         f"{MODULES}",
    "+ package_index.install()": "from vapo_megatron.config import package_index; package_index.install(); "
                                 "from vapo_megatron.mcore.megatron_import import import_megatron; import_megatron(); "
                                 f"{MODULES}",
}


def cpu_seconds(code: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for _ in range(a.repeats):
        for way, code in WAYS.items():  # alternating: a load that comes and goes hits both
            times[way].append(cpu_seconds(code))
    base = statistics.median(times[next(iter(WAYS))])
    for way, ts in times.items():
        m = statistics.median(ts)
        print(f"{way:28s} median {m:6.2f} s CPU  ({', '.join(f'{t:.2f}' for t in ts)})  ratio to plain {m / base:.2f}")


if __name__ == "__main__":
    main()
