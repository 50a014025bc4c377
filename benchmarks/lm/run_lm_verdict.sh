#!/usr/bin/env bash
# Runs the language-model verdict's protocol (benchmarks/lm/verdict_lm.py, docs/lm_protocol.md) on
# both tasks in the background, at low priority (nice 19), resumably: each decay's record is
# appended to benchmarks/results/lm_<task>_runs.jsonl as it ends (lm_<task>.json is written when a
# task's runs end); started again (here or on another machine with the committed store), it goes
# on from there. A stop is retried up to RETRIES times. To commit a partial store, first write the
# JSON and docs/results.md's blocks from it:
#   python benchmarks/lm/verdict_lm.py --task all --analyse --update-docs
#
# Usage (from anywhere; with the project's virtualenv active):
#   benchmarks/lm/run_lm_verdict.sh                 # detached: both tasks, in the protocol's order
#   benchmarks/lm/run_lm_verdict.sh --foreground    # in this shell
#
# Progress: benchmarks/results/logs/lm_verdict.log (ignored by git; LM_LOGS moves it). The detached
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
log="$LOGS/lm_verdict.log"
for attempt in $(seq 1 "$RETRIES"); do
  echo "== $(date -u +%FT%TZ) attempt $attempt" >> "$log"
  status=0
  # shellcheck disable=SC2086  # VERDICT_LM_FLAGS is a list of flags
  nice -n 19 "$PYTHON" benchmarks/lm/verdict_lm.py --task all ${VERDICT_LM_FLAGS:-} \
    >> "$log" 2>&1 || status=$?
  if [ "$status" -eq 0 ]; then
    echo "== $(date -u +%FT%TZ) done" >> "$log"
    break
  fi
  echo "== $(date -u +%FT%TZ) stopped (exit $status); resuming" >> "$log"
done
