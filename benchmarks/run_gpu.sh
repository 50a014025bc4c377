#!/usr/bin/env bash
# One GPU, one call: the numbers only a GPU can give, the most valuable first, each part saving
# its results as it finishes, all within BUDGET seconds (default 540: one call of at most
# 10 minutes with the interpreter's starts).
#
#   bash benchmarks/run_gpu.sh                                   # one GPU
#   RESULTS=/some/folder bash benchmarks/run_gpu.sh
#   DEVICE=cpu SIZE=tiny STEPS=5 RESULTS=/tmp/try bash benchmarks/run_gpu.sh   # try it on a CPU
#
# Parts, in order (each a process of its own under `timeout`; a part cut short keeps what its
# JSON holds, and the next part runs in what is left):
#   1. step_cost: the plain step, value_and_half_grads, the Trainer's measuring and plain
#      programs and the measure_every=4 cycle, for the LM (13M parameters, 64 x 256 tokens)
#      and the 4-stage CNN (4.7M parameters, 512 images of 32x32)
#      (RESULTS/one_device_steps_gpu_goals.json; docs/results.md's one-device tables).
#   2. cold_start: the LM recipe and the README's demo, adaptive against the batch held fixed,
#      seed 0, a cold compilation cache (RESULTS/cold_start_gpu.json; the cold-start table).
#   3. step_cost, the rest: ResNet-18 at 128, the MLP and the small CNN, every passes policy
#      (RESULTS/one_device_steps_gpu.json).
#   4. cold_start, warm: the same runs on the cache part 2 filled, in new workdirs
#      (RESULTS/cold_start_gpu_warm.json).
# The two benchmarks' own scripts (benchmarks/step_cost/run_gpu.sh,
# benchmarks/cold_start/run_gpu.sh) take each one's whole set in a call of its own. The training
# scripts need ml_collections (and tensorboardX, for TensorBoard): where the machine lacks them
# and cannot reach a package index, bring their wheels. Prepared where an index is reachable,
# in a folder that git ignores and the call carries:
#
#   pip download --no-deps -d .gpu_wheels ml_collections tensorboardX
#   echo /.gpu_wheels/ >> .git/info/exclude
#
# and run on the GPU machine, from the repository's root:
#
#   pip install -q --no-deps .gpu_wheels/*.whl && RESULTS=$OUT bash benchmarks/run_gpu.sh
#
# (a machine that sends back only what a folder such as $OUT holds: its four JSON files).
set -u
cd "$(dirname "$0")/.."
DEVICE="${DEVICE:-gpu}"
SIZE="${SIZE:-full}"
STEPS="${STEPS:-}"
RESULTS="${RESULTS:-benchmarks/results}"
RUNS="${RUNS:-/tmp/simigrad_gpu_runs}" # the cold-start runs' workdirs and caches (not results)
BUDGET="${BUDGET:-540}"
STEP_COST=(python benchmarks/step_cost/one_device_steps.py --size "$SIZE")
if [ "$DEVICE" = "gpu" ]; then STEP_COST=(env JAX_PLATFORMS=cuda "${STEP_COST[@]}"); fi
mkdir -p "$RESULTS" "$RUNS"
python -c "import jax; print('devices:', jax.devices())"

# shellcheck source=run_parts.sh
source benchmarks/run_parts.sh

GOAL_STEPS=plain,halves_sequential,trainer_sequential,trainer_plain,trainer_every_4
COLD=(python benchmarks/cold_start/cold_start.py --device "$DEVICE" --recipes lm,demo
  --variants adaptive,fixed --seeds 1 ${STEPS:+--steps "$STEPS"})

run_part "step_cost: the goals' steps" 200 "${STEP_COST[@]}" --workloads lm,cnn4 \
  --steps "$GOAL_STEPS" --out "$RESULTS/one_device_steps_gpu_goals.json"
run_part "cold_start: cold" 240 "${COLD[@]}" --caches cold --workdir "$RUNS" \
  --out "$RESULTS/cold_start_gpu.json"
run_part "step_cost: the rest" 150 "${STEP_COST[@]}" --workloads resnet18,mlp,cnn \
  --out "$RESULTS/one_device_steps_gpu.json"
run_part "cold_start: warm" "$BUDGET" "${COLD[@]}" --caches warm --workdir "$RUNS" \
  --out "$RESULTS/cold_start_gpu_warm.json"
echo "== done in ${SECONDS}s; results in $RESULTS"
