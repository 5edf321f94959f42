"""What the critic costs: the same run with algo.estimator=gae (VAPO/PPO, actor + critic) and
algo.estimator=grpo (GRPO/DAPO, actor only), side by side in one invocation.

Both runs: configs/demo_cpu.yaml on the demo task (torchrun, 2 ranks, TP=2, embedded engine), no
warm start and no value pretraining (so every step is a full RL step of both kinds), the same
seed, prompts and sample budget; the grpo run drops the config's critic-only keys (the trainer
refuses them with grpo). Each is launched from its own small Python parent, which reports the
largest resident set of any of its descendants (getrusage RUSAGE_CHILDREN: a trainer rank with
its models, optimizer state and, on rank 0, the rollout engine). Per-step times are medians of
perf/* over the steps after the first (metrics.jsonl).

    python -m benchmarks.estimators [--steps 8] [--out runs/bench_estimators]

Prints per phase `gae  grpo  ratio (grpo / gae)`, then peak RSS and its ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
PHASES = ("rollout", "reward", "score", "critic_update", "actor_update", "sync", "step")

# The parent of one run: torchrun, then the peak RSS of its largest descendant (KiB on Linux).
PARENT = r"""
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:]).returncode
print("PEAK_RSS_KIB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)
sys.exit(rc)
"""


def config_for(estimator: str, tmp: Path) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    if estimator == "grpo":
        from vapo_megatron.config.checks import CRITIC_ONLY

        for key in CRITIC_ONLY:
            section, _, name = key.partition(".")
            if name:
                cfg.get(section, {}).pop(name, None)
            else:
                cfg.pop(section, None)
        cfg["algo"]["estimator"] = "grpo"
    path = tmp / f"{estimator}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(estimator: str, data: Path, out: Path, steps: int, tmp: Path) -> dict:
    run_dir = out / estimator
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [PY, "-c", PARENT, PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(29000 + os.getpid() % 1000 + (estimator == "grpo")),
           "-m", "vapo_megatron.train", "--config", str(config_for(estimator, tmp)),
           f"trainer.run_dir={run_dir}", f"model.hf_path={data}/model", f"data.train_files=[{data}/train.jsonl]",
           "data.eval_files=[]", "sft.steps=0", "algo.value_pretrain_steps=0", f"trainer.total_steps={steps}",
           "trainer.save_every=1000", "trainer.export_hf=false", "trainer.tensorboard=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        sys.exit(f"bench_estimators: the {estimator} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rss_kib = int(proc.stdout.rsplit("PEAK_RSS_KIB", 1)[1].split()[0])
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = [r for r in recs if r["phase"] == "vapo"][1:]  # the first step pays one-off costs
    times = {p: statistics.median(r.get(f"perf/{p}_s", 0.0) for r in rl) for p in PHASES}
    return {"times": times, "rss_gib": rss_kib / 2**20,
            "critic_metrics": sorted({k for r in rl for k in r if k.startswith("critic/")})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="runs/bench_estimators")
    args = ap.parse_args()
    out = (REPO / args.out).resolve()
    data = out / "data"
    if not (data / "model").exists():
        subprocess.run([PY, str(REPO / "scripts" / "make_demo_data.py"), "--out", str(data)], check=True,
                       capture_output=True, cwd=REPO)
    with tempfile.TemporaryDirectory() as tmp:
        res = {e: run(e, data, out, args.steps, Path(tmp)) for e in ("gae", "grpo")}
    print(f"demo_cpu.yaml, {args.steps} RL steps each (64 prompts x 8 samples), median over steps 2..{args.steps}")
    print(f"{'seconds per step':<22}{'gae':>8}{'grpo':>8}{'grpo/gae':>10}")
    for p in PHASES:
        g, r = res["gae"]["times"][p], res["grpo"]["times"][p]
        print(f"  {p:<20}{g:8.3f}{r:8.3f}{(r / g if g > 0 else float('nan')):10.2f}")
    g, r = res["gae"]["rss_gib"], res["grpo"]["rss_gib"]
    print(f"{'peak RSS of a rank, GiB':<22}{g:8.3f}{r:8.3f}{r / g:10.2f}")
    print(f"critic metrics logged: gae {len(res['gae']['critic_metrics'])}, grpo {len(res['grpo']['critic_metrics'])}")


if __name__ == "__main__":
    main()
