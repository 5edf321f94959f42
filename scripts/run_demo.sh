#!/usr/bin/env bash
# `make demo`: the embedded VAPO run on the CPU (TP=2, two processes), from nothing to a
# trained model in runs/demo/ (metrics.jsonl, checkpoints/, curves.png, hf/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
RUN=runs/demo
start=$(date +%s)
if [ ! -f "$RUN/data/meta.json" ]; then
  echo "demo: writing the synthetic task, tokenizer and tiny model to $RUN/data"
  "$PY" scripts/make_demo_data.py --out "$RUN/data" >/dev/null
fi
# An interrupted demo resumes from its last checkpoint, a finished one is reported again; a
# changed configuration is refused, naming each changed setting (vapo_megatron/run_config.py).
# To start over: rm -rf runs/demo/checkpoints runs/demo/metrics.jsonl (or another trainer.run_dir).
"$PY" -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "${VAPO_DEMO_PORT:-29517}" \
  -m vapo_megatron.train --config configs/demo_cpu.yaml "$@" 2> >(grep -v -E "UserWarning|warnings.warn|DEPRECATED|RNG state changed|^\s*$" >&2)
"$PY" scripts/plot_metrics.py "$RUN"
"$PY" scripts/demo_report.py "$RUN" --seconds $(( $(date +%s) - start ))
