#!/usr/bin/env bash
# `make demo`: the embedded VAPO run on the CPU (TP=2, two processes), from nothing to a
# trained model in runs/demo/ (metrics.jsonl, checkpoints/, curves.png, hf/).
#   VAPO_DEMO_SEED=N  one seed for everything random (default 0): the tiny model's init and the
#                     data split (make_demo_data.py --seed), prompt order (data.seed), rollout
#                     sampling and the critic's value head (trainer.seed)
#   VAPO_DEMO_RUN=DIR run directory (default runs/demo, or runs/<config name> with VAPO_DEMO_CONFIG);
#                     scripts/demo_seeds.sh uses one per seed
#   VAPO_DEMO_CONFIG=FILE the config (default configs/demo_cpu.yaml; the baselines on the same task:
#                     configs/grpo.yaml, configs/dapo.yaml, configs/vanilla_ppo.yaml)
# Extra arguments are dotted config overrides for vapo-train.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
SEED=${VAPO_DEMO_SEED:-0}
CONFIG=${VAPO_DEMO_CONFIG:-configs/demo_cpu.yaml}
# runs/demo for the demo's config, runs/<config name> for another (each run directory keeps its settings)
DEFAULT_RUN=runs/demo
[ "$CONFIG" = configs/demo_cpu.yaml ] || DEFAULT_RUN=runs/$(basename "$CONFIG" .yaml)
RUN=${VAPO_DEMO_RUN:-$DEFAULT_RUN}
DATA=$RUN/data
start=$(date +%s)
if ! "$PY" -c "import json, sys; sys.exit(json.load(open(sys.argv[1]))['seed'] != int(sys.argv[2]))" "$DATA/meta.json" "$SEED" 2>/dev/null; then
  echo "demo: writing the synthetic task, tokenizer and tiny model (seed $SEED) to $DATA"
  # New data: whatever was trained on other data is no longer this run's.
  rm -rf "$DATA" "$RUN/checkpoints" "$RUN/hf" "$RUN/metrics.jsonl" "$RUN/tensorboard" "$RUN/curves.png"
  "$PY" scripts/make_demo_data.py --out "$DATA" --seed "$SEED" >/dev/null
fi
# An interrupted demo resumes from its last checkpoint, a finished one is reported again; a
# changed configuration is refused, naming each changed setting (vapo_megatron/config/resume.py).
# To start over: rm -rf runs/demo/checkpoints runs/demo/metrics.jsonl (or another trainer.run_dir).
"$PY" -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "${VAPO_DEMO_PORT:-29517}" \
  -m vapo_megatron.train --config "$CONFIG" \
  trainer.run_dir="$RUN" model.hf_path="$DATA/model" "data.train_files=[$DATA/train.jsonl]" \
  "data.eval_files=[$DATA/eval.jsonl]" "sft.files=[$DATA/sft.jsonl]" trainer.seed="$SEED" data.seed="$SEED" \
  "$@" 2> >(grep -v -E "UserWarning|warnings.warn|DEPRECATED|RNG state changed|^\s*$" >&2)
"$PY" -m benchmarks.plot_metrics "$RUN"
"$PY" -m benchmarks.demo_report "$RUN" --seconds $(( $(date +%s) - start ))
