#!/usr/bin/env bash
# One GPU: the one-device step costs, most valuable first, each part saving as it finishes.
#
#   bash benchmarks/step_cost/run_gpu.sh                    # one GPU, full sizes (about 5-7 min)
#   RESULTS=/some/folder bash benchmarks/step_cost/run_gpu.sh
#   SIZE=tiny JAX_PLATFORMS=cpu RESULTS=/tmp/try bash benchmarks/step_cost/run_gpu.sh  # try it
#
# Parts, in order (each a process of its own under `timeout`, within BUDGET seconds in all,
# default 460, so that the whole fits in 8 minutes with the interpreter's start; the first
# part may take all but the last 60 s):
#   1. one_device_steps.py: the LM (13M parameters, 64 x 256 tokens) and the 4-stage CNN
#      (4.7M parameters, 512 images of 32x32), then ResNet-18 at 128, then the MLP and the
#      small CNN: the plain step, value_and_half_grads with each of its passes, and the
#      Trainer's step with each; its JSON is rewritten after every step, so a part cut short
#      keeps what finished (RESULTS/one_device_steps_gpu.json).
#   2. halves_steps.py --devices 1: every step a user can write on one device, for the
#      table of docs/own_step.md's "On one GPU" (RESULTS/halves_gpu.json), if time is left;
#      its JSON is rewritten after every model, so a part cut short keeps what finished.
set -u
cd "$(dirname "$0")/../.."
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
SIZE="${SIZE:-full}"
RESULTS="${RESULTS:-benchmarks/results}"
BUDGET="${BUDGET:-460}"
mkdir -p "$RESULTS"
python -c "import jax; print('devices:', jax.devices())"

# shellcheck source=../run_parts.sh
source benchmarks/run_parts.sh

run_part "one_device_steps" $((BUDGET - 60)) python benchmarks/step_cost/one_device_steps.py \
  --size "$SIZE" --out "$RESULTS/one_device_steps_gpu.json"
if [ "$SIZE" = "full" ]; then QUICK=(); else QUICK=(--quick); fi
run_part "halves_steps" "$BUDGET" python benchmarks/step_cost/halves_steps.py --devices 1 "${QUICK[@]}" \
  --out "$RESULTS/halves_gpu.json"
echo "== done in ${SECONDS}s; results in $RESULTS"
