"""A small Trainer run in its own process, for the kill-and-resume and multi-host tests.

python tests/train_driver.py --workdir DIR --steps N
    [--kill-at K | --kill-in-save K | --kill-in-compile J | --freeze-at K]
    [--num-processes P --process-id I --coordinator 127.0.0.1:PORT]
    [--disagree-at K] [--similarity-target X] [--max-micro-batch-size M] [--shapes-per-octave S]
    [--compile-cache DIR] [--mode recompile|pad] [--checkpoint-every C]
    [--agreement-timeout SECONDS] [--devices D] [--halves auto|device|local]
    [--hold-compiles K] [--no-compile-fallback] [--grain-workers W]
    [--checkpoint-every-seconds S] [--slow-save SECONDS] [--mesh-model M] [--fsdp]

Trains an MLP on a fixed synthetic classification set (600 examples) over D
devices in all (default 8; D // P simulated CPU devices per process), with
the Trainer's ``halves`` split; ``--mesh-model M``: on a mesh of D / M
positions of the data axis by M of a ``model`` axis, the MLP tensor-parallel
over it (``--fsdp``: each kernel also in blocks over the data axis). Prints
one JSON summary line at the end
(process 0). ``--grain-workers W`` reads the same rows through a
:class:`simigrad_jax.GrainSource` with W worker processes.

Fault injection (the process SIGKILLs itself: no clean-up, no final checkpoint):

* ``--kill-at K``: right after step K's metrics line is written;
* ``--kill-in-save K``: right after the checkpoint of step K was handed to
  orbax and its temporary folder exists, while its asynchronous save is still
  writing (this process's save of step K is held before it reaches orbax's
  barrier that all processes' writes are complete, and before orbax renames
  that folder, so neither this process nor the primary one can finish it
  first, however fast the write is);
* ``--kill-in-compile J``: 20 ms into the J-th micro-step compile run off
  the main thread (by a worker of the StepCompiler, or in the thread a step
  waiting for its program compiles it in); that compile is slowed down so the
  kill lands inside it, and the run's last step waits for it to start (the end
  of the run would otherwise cancel a compile still queued);
* ``--freeze-at K``: SIGSTOP right after step K (every thread stops, the
  sockets stay open, so a peer waits in its next collective as for a process
  that died in the middle of it); SIGKILL after twice the agreement timeout
  and 5 s.

Signals (sent by the test): a SIGTERM or SIGINT makes ``train`` raise
``simigrad_jax.Preempted``; the driver traces a ``preempted`` line and exits
with its ``exit_code``. ``--slow-save SECONDS`` traces a ``saving`` line and
sleeps that long before each checkpoint save (a window for a second
signal). ``--hold-for-signal K``: step K waits (in its trace) until the
process has received a stop signal, so that a signal sent after an earlier
step lands before the run ends, however late the test sends it.
``--checkpoint-every 0``: no checkpoint every so many steps.

Test-only trace: every process appends to ``<workdir>/trace.<process>.jsonl``
a ``start`` line (the step it resumed from), a ``step`` line per completed
step (its decision and the sorted indices of the examples this process
trained on), a ``kill`` line before a SIGKILL, and a ``lost`` line (the
processes a ProcessLostError names, and when) before the process exits with
status 1 on one. Process 1 of a multi-host run writes no metrics file, so its
trace is where its decisions show.

Compile timing: ``--hold-compiles K`` holds the compile of every
one-micro-batch program but the first step's until this process has finished
step K (each process may hold its own number of steps; micro-steps still
compile), so the compile fallback has shapes to cover, with accumulation;
``--no-compile-fallback`` waits for every shape instead, ``--timed-fallback`` falls back
on the compiles' timing (not the step count). Each ``step`` line
also has the step's ``micro_batch_size`` and ``compile_fallback``, and an
``end`` line has the final parameters.

Forced disagreements (multi-host, process 1 only): ``--disagree-at K`` makes
process 1's controller pick a different next batch size at step K;
``--similarity-target`` set per process gives them different settings.
"""

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("--workdir", required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--kill-in-save", type=int, default=None)
parser.add_argument("--kill-in-compile", type=int, default=None)
parser.add_argument("--freeze-at", type=int, default=None)
parser.add_argument("--num-processes", type=int, default=1)
parser.add_argument("--process-id", type=int, default=0)
parser.add_argument("--coordinator", default=None)
parser.add_argument("--mode", default="recompile")
parser.add_argument("--checkpoint-every", type=int, default=3)
parser.add_argument("--compile-cache", default=None)
parser.add_argument("--similarity-target", type=float, default=0.3)
parser.add_argument("--max-micro-batch-size", type=int, default=8)
# The halving grid: runs compared across kills and processes reach few shapes, so the shape a
# step runs on (its plan's, or a compile fallback's) seldom depends on the compile timing.
parser.add_argument("--shapes-per-octave", type=int, default=1)
parser.add_argument("--disagree-at", type=int, default=None)
parser.add_argument("--agreement-timeout", type=float, default=60.0)
parser.add_argument("--devices", type=int, default=8)
parser.add_argument("--halves", default="auto")
parser.add_argument("--hold-compiles", type=int, default=None)
parser.add_argument("--no-compile-fallback", action="store_true")
parser.add_argument("--timed-fallback", action="store_true")
parser.add_argument("--grain-workers", type=int, default=None)
parser.add_argument("--checkpoint-every-seconds", type=float, default=None)
parser.add_argument("--slow-save", type=float, default=None)
parser.add_argument("--hold-for-signal", type=int, default=None)
parser.add_argument("--mesh-model", type=int, default=None)
parser.add_argument("--fsdp", action="store_true")
args = parser.parse_args()

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simigrad_jax.multihost.cpu_devices import simulated_cpu_devices_env  # noqa: E402

os.environ.update(simulated_cpu_devices_env(args.devices // args.num_processes))

import jax  # noqa: E402

if args.num_processes > 1:
  jax.distributed.initialize(
    args.coordinator,
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=60,
  )

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import simigrad_jax  # noqa: E402
from simigrad_jax.compile import compiler as compiler_module  # noqa: E402
from simigrad_jax.compile.step_functions import APPLY  # noqa: E402
from simigrad_jax.compile.step_functions import Program  # noqa: E402

if args.compile_cache:  # before the model's first eager ops, so that they come from the cache too
  simigrad_jax.compile.enable_persistent_cache(args.compile_cache)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.tanh(nn.Dense(16)(x)))


def synthetic_data(num_examples=600, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(num_examples, 8)).astype(np.float32)
  teacher = rng.normal(size=(8, 4))
  y = np.argmax(x @ teacher + 1.5 * rng.normal(size=(num_examples, 4)), axis=1).astype(np.int32)
  return {"x": x, "y": y, "index": np.arange(num_examples, dtype=np.int32)}


def loss_fn(params, model_state, batch, weights, rng):
  del weights, rng
  logits = MLP().apply({"params": params}, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), model_state


process = jax.process_index()
trace_file = None  # opened on first use (the Trainer creates the workdir)


def trace(record):
  global trace_file
  if trace_file is None:
    trace_file = open(os.path.join(args.workdir, f"trace.{process}.jsonl"), "a", encoding="utf-8")
  trace_file.write(json.dumps(record) + "\n")
  trace_file.flush()


def die(kind, **details):
  trace({"event": "kill", "kind": kind, "time": time.time(), **details})
  os.kill(os.getpid(), signal.SIGKILL)


def freeze(**details):
  trace({"event": "kill", "kind": "freeze", "time": time.time(), **details})
  seconds = 2 * args.agreement_timeout + 5
  subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -9 {os.getpid()}"], start_new_session=True)
  os.kill(os.getpid(), signal.SIGSTOP)


def exit_if_lost(kind, error, tb):
  """A ProcessLostError ends the process at once, as in ``python -m train``."""
  if isinstance(error, simigrad_jax.multihost.ProcessLostError):
    try:
      trace(
        {
          "event": "lost",
          "time": time.time(),
          "processes": list(error.processes),
          "message": str(error),
        }
      )
    finally:
      simigrad_jax.multihost.exit_on_lost_process(error)
  sys.__excepthook__(kind, error, tb)


sys.excepthook = exit_if_lost


# --- kill inside a background compile: slow the J-th micro-step job run off the main thread down
# and kill 20 ms into it, or, if it starts while the trainer is built (the first step's program
# does), 20 ms after it is. (The update's compile, queued when the trainer is built, is not
# counted.) Under load a queued job may start in either thread: the lane's worker, or the thread
# that a step waiting for it compiles it in (train() runs with the compiler's interrupt set).
trainer_built = threading.Event()
kill_compile_started = threading.Event()
if args.kill_in_compile is not None:
  original_run = compiler_module.StepCompiler._run
  background_jobs = []

  def run_then_die(self, job):
    if threading.current_thread() is not threading.main_thread() and job.key != APPLY:
      background_jobs.append(job.key)
      if len(background_jobs) == args.kill_in_compile:
        kill_compile_started.set()
        lower = self._lower

        def slow_lower(key):
          lowered = lower(key)
          time.sleep(5.0)  # the kill lands while this job is in progress
          return lowered

        self._lower = slow_lower
        trace({"event": "compile_started", "program": job.what, "job": len(background_jobs)})
        details = {"program": job.what, "job": len(background_jobs)}

        def die_once_built():
          trainer_built.wait()  # (the kill's trace follows the run's start in the trace)
          time.sleep(0.02)
          die("compile", **details)

        threading.Thread(target=die_once_built, daemon=True).start()
    return original_run(self, job)

  compiler_module.StepCompiler._run = run_then_die

params = MLP().init(jax.random.key(0), np.zeros((1, 8), np.float32))["params"]
optimizer = optax.chain(
  simigrad_jax.transform("batch"), optax.sgd(0.2, momentum=0.9), simigrad_jax.scale_by_lr_factor()
)
controller = simigrad_jax.Controller(
  48, args.similarity_target, batch_size_lower_bound=16, batch_size_upper_bound=160
)
if args.disagree_at is not None and process == 1:
  original_update = controller.update

  def update_differently(similarity, stats=None):
    size = original_update(similarity, stats)
    if controller.step == args.disagree_at:  # a different decision on this process only
      controller.set_batch_size(size + 1 if size < 160 else size - 1)
    return controller.batch_size

  controller.update = update_differently

if args.grain_workers is None:
  source = simigrad_jax.ArraySource(synthetic_data())
else:
  import driver_records  # noqa: E402  (a module grain's spawned workers can import)

  # Spawned worker processes re-run the main script unless it has no __file__; this script has
  # no `if __name__ == "__main__"` guard, so it hides its path from them.
  del sys.modules["__main__"].__file__
  source = simigrad_jax.GrainSource(
    driver_records.Rows(synthetic_data()), num_workers=args.grain_workers, buffer_size=16
  )
mesh_settings = {}
if args.mesh_model is not None:
  from jax.sharding import Mesh  # noqa: E402
  from jax.sharding import PartitionSpec as P  # noqa: E402

  mesh_settings = {
    "mesh": Mesh(
      np.array(jax.devices()).reshape(-1, args.mesh_model), ("batch", "model")
    ),  # devices in process order: each process holds whole positions of the data axis
    # Dense_1 (8 -> 16) column-parallel, then Dense_0 (16 -> 4) row-parallel.
    "param_sharding": {
      "Dense_0": {"kernel": P("model", "batch" if args.fsdp else None), "bias": None},
      "Dense_1": {"kernel": P("batch" if args.fsdp else None, "model"), "bias": P("model")},
    },
  }
trainer = simigrad_jax.Trainer(
  **mesh_settings,
  loss_fn=loss_fn,
  params=params,
  optimizer=optimizer,
  source=source,
  controller=controller,
  workdir=args.workdir,
  config=simigrad_jax.TrainerConfig(
    max_micro_batch_size=args.max_micro_batch_size,
    seed=1,
    progress=False,
    tensorboard=False,
    halves=args.halves,
    agreement_timeout_seconds=args.agreement_timeout,
    compile=simigrad_jax.CompileConfig(
      mode=args.mode,
      shapes_per_octave=args.shapes_per_octave,
      fallback=not args.no_compile_fallback,
      timed_fallback=args.timed_fallback,
      cache_dir=args.compile_cache,
    ),
    checkpoints=simigrad_jax.CheckpointConfig(
      every_steps=args.checkpoint_every or None, every_seconds=args.checkpoint_every_seconds
    ),
  ),
)
trainer_built.set()
trace(
  {
    "event": "start",
    "pid": os.getpid(),
    "step": trainer.step,
    "examples_seen": trainer.sampler.examples_seen,
    "skipped_checkpoints": [s for s, _ in trainer._checkpoints.checkpointer.skipped],
  }
)

# --- hold every compile but the first step's shape until this process has finished step K.
compiles_released = threading.Event()
if args.hold_compiles is not None:
  first_shape = trainer.layout.plan(controller.batch_size).micro_batch_size
  held_compiler = trainer._programs.compiler  # (micro-steps compile: the fallback's)

  def held_lower(key, lower=held_compiler._lower):
    if key.program is Program.FUSED and key.micro != first_shape:
      compiles_released.wait(timeout=30)  # (a step that needs the shape waits this long)
    return lower(key)

  held_compiler._lower = held_lower

# --- the examples each step trained on (this process's real rows), logged once the step is done.
placed = []
original_take = trainer._data.take


def recording_take(plan, start, step):
  step_data, seconds = original_take(plan, start, step)
  rows = []
  for batch, weights in step_data.micro_batches:
    index = np.concatenate(
      [
        np.asarray(s.data)
        for s in sorted(batch["index"].addressable_shards, key=lambda s: s.index[0].start)
      ]
    )
    weight = np.concatenate(
      [
        np.asarray(s.data)
        for s in sorted(weights.addressable_shards, key=lambda s: s.index[0].start)
      ]
    )
    rows.append(index[weight > 0])
  placed.append(np.sort(np.concatenate(rows)).tolist())
  return step_data, seconds


trainer._data.take = recording_take


class DecidedSteps:
  """Traces each step as soon as it is decided, and dies or freezes there when asked."""

  runs_at_once = True

  def on_step(self, record):
    trace_then_maybe_die(record)


def trace_then_maybe_die(record):
  trace(
    {
      "event": "step",
      **{
        k: getattr(record, k)
        for k in (
          "step",
          "batch_size",
          "next_batch_size",
          "lr_factor",
          "next_lr_factor",
          "decision",
          "loss",
          "similarity",
          "examples_seen",
          "micro_batch_size",
          "compile_fallback",
        )
      },
      "indices": placed.pop(),
    }
  )
  if record.step == args.hold_compiles:
    compiles_released.set()
  if record.step == args.kill_at:  # the next step is not dispatched yet
    die("between_steps", step=record.step)
  if record.step == args.freeze_at:
    freeze(step=record.step)
  if record.step == args.hold_for_signal:
    # A signal sent late (the test's process is not run for a while) would find the run ended.
    deadline = time.monotonic() + 120  # (then the run ends unsignalled: the test fails)
    while not trainer._loop.stop.signalled and time.monotonic() < deadline:
      time.sleep(0.01)
  if record.step == args.steps and args.kill_in_compile is not None:
    # A compile still queued when the run ends is cancelled: the J-th must start first.
    kill_compile_started.wait(timeout=120)  # (then the run ends unkilled: the test fails)


trainer.add_hook(DecidedSteps())

if args.kill_in_save is not None:
  checkpointer = trainer._checkpoints.checkpointer
  original_save = checkpointer.save

  # Hold step K's save before orbax renames its temporary folder to the final one,
  # so the kill lands while that save is unfinished however fast the write is.
  from orbax.checkpoint._src.path import atomicity

  original_finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def finalize_unless_held(self):
    if self._final_path.name == str(args.kill_in_save):
      await asyncio.sleep(600.0)  # the process is killed long before
    await original_finalize(self)

  atomicity.AtomicRenameTemporaryPath.finalize = finalize_unless_held

  # With several processes the primary one renames the folder once every process's
  # write has reached orbax's barrier: hold this process's background save of step K
  # before that barrier, so that the primary cannot commit step K before the kill.
  from orbax.checkpoint._src.checkpointers import async_checkpointer as orbax_async

  original_background_wait = orbax_async._background_wait_for_commit_futures

  def background_wait_unless_held(directory, *positional, **keywords):
    if str(args.kill_in_save) in str(directory).split(os.sep):
      time.sleep(600.0)  # the process is killed long before
    return original_background_wait(directory, *positional, **keywords)

  orbax_async._background_wait_for_commit_futures = background_wait_unless_held

  def save_then_die(step, state, host):
    original_save(step, state, host)
    if step == args.kill_in_save:
      # orbax may create the temporary folder in its background thread: wait for it
      # (the save cannot finish, its finalize is held), so the kill lands mid-save.
      deadline = time.monotonic() + 60.0
      while True:
        pending = [n for n in os.listdir(checkpointer.directory) if "tmp" in n]
        if pending or time.monotonic() > deadline:
          break
        time.sleep(0.01)
      die(
        "save",
        step=step,
        tmp_dirs=pending,
        finished=os.path.isdir(os.path.join(checkpointer.directory, str(step))),
      )

  checkpointer.save = save_then_die

if args.slow_save is not None:
  slowed_save = trainer._checkpoints.checkpointer.save

  def save_slowly(step, state, host):
    trace({"event": "saving", "step": step, "time": time.time()})
    time.sleep(args.slow_save)
    slowed_save(step, state, host)

  trainer._checkpoints.checkpointer.save = save_slowly

with trainer:
  try:
    summary = trainer.train(num_steps=args.steps)
  except simigrad_jax.Preempted as stop:
    trace(
      {
        "event": "preempted",
        "signal": stop.signal.name,
        "step": stop.step,
        "checkpoint": stop.checkpoint,
        "saved": os.path.isdir(stop.checkpoint),
        "time": time.time(),
      }
    )
    print(stop)
    sys.exit(stop.exit_code)
  finally:
    compiles_released.set()
  trace(
    {
      "event": "end",
      "params": [
        np.asarray(leaf.addressable_data(0)).ravel().tolist()
        for leaf in jax.tree.leaves(trainer.state["params"])
      ],
    }
  )
if process == 0:
  print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))
