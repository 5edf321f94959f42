"""How long vapo-plan --search takes as the number of GPUs grows: the search alone (after the imports,
which every vapo-plan pays), each world size in a fresh interpreter (nothing built by one carries
to the next), the sizes alternating over the repeats so that a load that comes and goes hits all.

    python -m benchmarks.plan_search [--repeats 3] [--gpus 8,16,32,64,128,256,512]
           [--config configs/qwen2.5_32b_vapo.yaml --preset qwen2.5-32b] [--gpus-per-node 8] [--gpu h100]

Prints per world size the median wall and CPU seconds of the search, the layouts it tried and
found fitting, and the ratios of its times to the 64-GPU search's (or the first size's). On a
shared machine the CPU seconds are the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
from vapo_megatron.config.quiet import quiet_startup
quiet_startup()
from vapo_megatron.mcore.megatron_import import import_megatron
import_megatron()
from model_providers.presets import preset
from vapo_megatron.config import parse_config
from vapo_megatron.sizing.hardware import GPUS
from vapo_megatron.sizing.search import Assumptions, search

config, name, world, node, gpu = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
hf = {**preset(name), "_source": name}
cfg = parse_config(config, [])[0]
a = Assumptions(gpu=GPUS[gpu], gpus_per_node=node, gpu_memory_gib=GPUS[gpu].memory_gib)
wall, cpu = time.perf_counter(), time.process_time()
result = search(cfg, hf, hf, world=world, a=a)
print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "tried": result.tried,
                  "fit": len(result.rows)}))
"""


def run(config: str, preset: str, gpus: int, node: int, gpu: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, config, preset, str(gpus), str(node), gpu], cwd=ROOT,
                         check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpus", default="8,16,32,64,128,256,512")
    ap.add_argument("--config", default="configs/qwen2.5_32b_vapo.yaml")
    ap.add_argument("--preset", default="qwen2.5-32b")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", default="h100")
    a = ap.parse_args()
    sizes = [int(g) for g in a.gpus.split(",")]
    runs: dict[int, list[dict]] = {g: [] for g in sizes}
    for _ in range(a.repeats):
        for g in sizes:  # alternating
            runs[g].append(run(a.config, a.preset, g, a.gpus_per_node, a.gpu))
    base = 64 if 64 in sizes else sizes[0]
    base_wall = statistics.median(r["wall"] for r in runs[base])
    base_cpu = statistics.median(r["cpu"] for r in runs[base])
    print(f"vapo-plan --search, {a.config} ({a.preset}), {a.gpus_per_node} GPUs per node, --gpu {a.gpu}; "
          f"median of {a.repeats}, the search alone (imports not counted)")
    for g in sizes:
        wall = statistics.median(r["wall"] for r in runs[g])
        cpu = statistics.median(r["cpu"] for r in runs[g])
        last = runs[g][-1]
        each = ", ".join(f"{r['wall']:.2f}" for r in runs[g])
        print(f"{g:5d} GPUs: {wall:6.2f} s wall ({each}), {cpu:6.2f} s CPU; "
              f"{last['tried']:5d} layouts tried, {last['fit']:4d} fit; against {base} GPUs: "
              f"wall x{wall / base_wall:.2f}, CPU x{cpu / base_cpu:.2f}")


if __name__ == "__main__":
    main()
