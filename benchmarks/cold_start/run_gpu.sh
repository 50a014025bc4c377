#!/usr/bin/env bash
# One GPU: a recipe's cold and warm start (cold_start.py), adaptive against its batch held fixed,
# the README's demo first, then the LM recipe, each run saved as it ends.
#
#   bash benchmarks/cold_start/run_gpu.sh                        # one GPU (about 6-8 min)
#   RESULTS=/some/folder bash benchmarks/cold_start/run_gpu.sh
#   DEVICE=cpu STEPS=5 RESULTS=/tmp/try bash benchmarks/cold_start/run_gpu.sh   # try it on a CPU
#
# Each recipe runs seed 0 of the adaptive and the fixed variant, with a cold compilation cache and
# then warm in a new workdir (four runs, one after the other), as a process of its own under
# `timeout`, within BUDGET seconds in all (default 480, so that the whole fits in one 8-minute
# call with the interpreter's start; the demo may take all but the last 200 s). cold_start.py
# rewrites its JSON after every run (RESULTS/cold_start_gpu_<recipe>.json), so a recipe cut short
# keeps what finished. The recipes run as written (their full length) unless STEPS is set. The
# training scripts need ml_collections (and tensorboardX only where TensorBoard is on, which
# cold_start.py turns off): where the machine lacks it, install it first.
set -u
cd "$(dirname "$0")/../.."
DEVICE="${DEVICE:-gpu}"
RESULTS="${RESULTS:-benchmarks/results}"
BUDGET="${BUDGET:-480}"
STEPS="${STEPS:-}"
mkdir -p "$RESULTS"
python -c "import jax; print('devices:', jax.devices())"

# shellcheck source=../run_parts.sh
source benchmarks/run_parts.sh

run_recipe() {  # run_recipe RECIPE SECONDS_AT_MOST
  run_part "$1" "$2" python benchmarks/cold_start/cold_start.py --device "$DEVICE" \
    --recipes "$1" --variants adaptive,fixed --seeds 1 ${STEPS:+--steps "$STEPS"} \
    --out "$RESULTS/cold_start_gpu_$1.json"
}

run_recipe demo $((BUDGET - 200))
run_recipe lm "$BUDGET"
echo "== done in ${SECONDS}s; results in $RESULTS"
