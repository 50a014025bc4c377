#!/usr/bin/env bash
# Runs the causal-LM comparison (benchmarks/lm/pareto_lm.py) on both budgets in the background, at
# low priority (nice 19), resumably: each finished run is kept in OUT.runs.jsonl, so a killed
# comparison started again goes on from there. Each budget is retried up to RETRIES times.
#
# Usage (from anywhere; with the project's virtualenv active):
#   benchmarks/lm/run_lm_budgets.sh                 # both budgets, today's then the long one
#   benchmarks/lm/run_lm_budgets.sh long            # one budget
#   benchmarks/lm/run_lm_budgets.sh --foreground    # in this shell, not detached
#
# Progress: benchmarks/results/logs/pareto_lm_BUDGET.log (ignored by git; LM_LOGS moves it); the
# detached job's process id: benchmarks/results/logs/run_lm_budgets.pid (kill it to stop; run
# again to resume).
# Results: benchmarks/results/pareto_lm.json and pareto_lm_long.json, plots in docs/.
# On a machine with a GPU, set JAX_PLATFORMS=cuda (the default is the CPU with 8 simulated
# devices) for the long budget; extra flags for pareto_lm.py go in PARETO_LM_FLAGS.
set -euo pipefail

cd "$(dirname "$0")/../.."
LOGS=${LM_LOGS:-benchmarks/results/logs}
mkdir -p "$LOGS"
PYTHON=${PYTHON:-python}
RETRIES=${RETRIES:-3}

foreground=0
budgets=()
for arg in "$@"; do
  case "$arg" in
    --foreground) foreground=1 ;;
    today | long) budgets+=("$arg") ;;
    *)
      echo "unknown argument '$arg'; give today, long or --foreground" >&2
      exit 2
      ;;
  esac
done
[ ${#budgets[@]} -eq 0 ] && budgets=(today long)

if [ "$foreground" -eq 0 ]; then
  nohup setsid "$0" --foreground "${budgets[@]}" > "$LOGS/run_lm_budgets.out" 2>&1 &
  echo $! > "$LOGS/run_lm_budgets.pid"
  echo "started (pid $(cat "$LOGS/run_lm_budgets.pid")); progress in $LOGS/pareto_lm_*.log"
  exit 0
fi

for budget in "${budgets[@]}"; do
  log="$LOGS/pareto_lm_$budget.log"
  for attempt in $(seq 1 "$RETRIES"); do
    echo "== $(date -u +%FT%TZ) budget $budget, attempt $attempt" >> "$log"
    status=0
    # shellcheck disable=SC2086  # PARETO_LM_FLAGS is a list of flags
    nice -n 19 "$PYTHON" benchmarks/lm/pareto_lm.py --budget "$budget" ${PARETO_LM_FLAGS:-} \
      >> "$log" 2>&1 || status=$?
    if [ "$status" -eq 0 ]; then
      echo "== $(date -u +%FT%TZ) budget $budget done" >> "$log"
      break
    fi
    echo "== $(date -u +%FT%TZ) budget $budget stopped (exit $status); resuming" >> "$log"
  done
done
