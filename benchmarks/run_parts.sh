#!/usr/bin/env bash
# Sourced by the GPU scripts (benchmarks/*/run_gpu.sh): their parts within one time budget.
#
#   BUDGET=460; source benchmarks/run_parts.sh
#   run_part NAME SECONDS_AT_MOST COMMAND...   # COMMAND under `timeout`, within what is left
#
# A part gets at most SECONDS_AT_MOST and what is left of BUDGET (counted by bash's SECONDS from
# the script's start); with under 20 s left it is skipped. A part cut short says so and the
# script goes on: each part saves its results as they finish, so it keeps what it finished.

left() { echo $((BUDGET - SECONDS)); }

run_part() {
  local name="$1" most="$2"
  shift 2
  local limit
  limit=$(left)
  if [ "$limit" -gt "$most" ]; then limit="$most"; fi
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped, ${limit}s left"
    return
  fi
  echo "== $name (at most ${limit}s)"
  timeout "$limit" "$@" || echo "== $name: exit status $? (its JSON keeps what finished)"
}
