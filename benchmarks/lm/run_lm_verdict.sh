#!/usr/bin/env bash
# Runs the language-model verdict's protocol (benchmarks/lm/verdict_lm.py, docs/lm_protocol.md) on
# both tasks in the background, at low priority (nice 19), resumably: each decay's record is
# appended to benchmarks/results/lm_<task>_runs.jsonl as it ends (lm_<task>.json is written when a
# task's runs end); started again (here or on another machine with the committed store), it goes
# on from there. A stop is retried up to RETRIES times. LM_WORKERS processes (2 by default: on
# two cores, two frontiers side by side take 1.5x the time of one alone) share the stores, each
# running every LM_WORKERS-th evaluation frontier (verdict_lm.py --worker; the tuning is the
# first's). To commit a partial store, first write the JSON and docs/results.md's blocks from it:
#   python benchmarks/lm/verdict_lm.py --task all --analyse --update-docs
#
# Usage (from anywhere; with the project's virtualenv active):
#   benchmarks/lm/run_lm_verdict.sh                 # detached: both tasks, in the protocol's order
#   benchmarks/lm/run_lm_verdict.sh --foreground    # in this shell
#
# Progress: benchmarks/results/logs/lm_verdict.log, the other workers' in lm_verdict.1.log, ...
# (ignored by git; LM_LOGS moves them). The detached
# job's process group: benchmarks/results/logs/run_lm_verdict.pgid:
#   kill -STOP -- -$(cat benchmarks/results/logs/run_lm_verdict.pgid)   # pause
#   kill -CONT -- -$(cat benchmarks/results/logs/run_lm_verdict.pgid)   # resume
#   kill -TERM -- -$(cat benchmarks/results/logs/run_lm_verdict.pgid)   # stop (the step under way
#                                                                        # ends; run again to go on)
# Extra flags for verdict_lm.py go in VERDICT_LM_FLAGS.
set -euo pipefail

cd "$(dirname "$0")/../.."
LOGS=${LM_LOGS:-benchmarks/results/logs}
mkdir -p "$LOGS"
PYTHON=${PYTHON:-python}
RETRIES=${RETRIES:-3}
WORKERS=${LM_WORKERS:-2}

case "${1:-}" in
  "") ;;
  --foreground) ;;
  *)
    echo "unknown argument '$1'; give nothing or --foreground" >&2
    exit 2
    ;;
esac

if [ "${1:-}" != "--foreground" ]; then
  nohup setsid "$0" --foreground > "$LOGS/run_lm_verdict.out" 2>&1 &
  echo "started; progress in $LOGS/lm_verdict.log, process group in $LOGS/run_lm_verdict.pgid"
  exit 0
fi

ps -o pgid= $$ | tr -d ' ' > "$LOGS/run_lm_verdict.pgid"

# One worker's runs, retried: worker $1 of WORKERS, its log $2.
run_worker() {
  local worker="$1" log="$2" attempt status
  for attempt in $(seq 1 "$RETRIES"); do
    echo "== $(date -u +%FT%TZ) worker $worker/$WORKERS, attempt $attempt" >> "$log"
    status=0
    # shellcheck disable=SC2086  # VERDICT_LM_FLAGS is a list of flags
    nice -n 19 "$PYTHON" benchmarks/lm/verdict_lm.py --task all --worker "$worker/$WORKERS" \
      ${VERDICT_LM_FLAGS:-} >> "$log" 2>&1 || status=$?
    if [ "$status" -eq 0 ]; then
      echo "== $(date -u +%FT%TZ) done" >> "$log"
      return
    fi
    echo "== $(date -u +%FT%TZ) stopped (exit $status); resuming" >> "$log"
  done
}

for worker in $(seq 0 $((WORKERS - 1))); do
  log="$LOGS/lm_verdict.log"
  if [ "$worker" -gt 0 ]; then log="$LOGS/lm_verdict.$worker.log"; fi
  run_worker "$worker" "$log" &
  sleep 1 # (the first opens the stores first)
done
wait
