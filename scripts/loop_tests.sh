#!/usr/bin/env bash
# Runs the crash/restart tests N times in a row and tallies the rounds, to catch flaky ones:
#     bash scripts/loop_tests.sh [N] [pytest node ids...]
# Default tests: fault injection, stop signals, Slurm on one and two nodes (the tests themselves
# take tests/helpers/slurm_cluster.py's lock: one local cluster user per machine) and the restart test.
# Each round runs as `make test` does: two pytest-xdist workers, each file (and both Slurm files
# together) on one worker (tests/conftest.py), so a round sees the suite's own concurrency.
# One line per round, then the tally; each round's pytest output is kept in $LOG_DIR/round_K.log.
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-10}
shift || true
TESTS=("$@")
if [ ${#TESTS[@]} -eq 0 ]; then
  TESTS=(tests/e2e/test_fault_injection.py tests/e2e/test_stop_signals.py tests/e2e/test_slurm.py
         tests/e2e/test_slurm_multinode.py tests/e2e/test_train.py::test_restart_after_checkpoint_reaches_same_weights)
fi
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/loop_tests.XXXXXX)}
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
passed=0
for k in $(seq 1 "$N"); do
  start=$(date +%s)
  : >"$LOG_DIR/round_$k.log"
  ok=1
  .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "${TESTS[@]}" >>"$LOG_DIR/round_$k.log" 2>&1 || ok=0
  if [ $ok -eq 1 ]; then
    passed=$((passed + 1)); verdict=pass
  else
    verdict="FAIL ($(grep -E '^(FAILED|ERROR) ' "$LOG_DIR/round_$k.log" | tr '\n' ' '))"
  fi
  echo "round $k/$N: $verdict, $(( $(date +%s) - start )) s: $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$LOG_DIR/round_$k.log" | tr '\n' ' ')"
done
echo "tally: $passed/$N rounds passed (logs in $LOG_DIR)"
[ "$passed" -eq "$N" ]
