"""The interpreter's exit with compiles in flight (simigrad_jax.compile.compiler's exit hook).

A user's own script that trains a Trainer and returns normally, with a
neighbouring shape still compiling inside XLA, exits 0 (before the hook, the
interpreter's shutdown met the compile inside JAX and the process aborted
with status 134); and in one process, on a fresh record of the compiles in
flight: the exit cancels queued compiles, starts no new one and waits for
those in progress, unless the run stopped on a signal; and ``python -m train`` stopped by Ctrl-C
while its shapes compile exits with its checkpoint whole.
"""

import atexit
import io
import json
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
from compiler_test import TIMEOUT
from compiler_test import Lowerer
from compiler_test import mesh  # noqa: F401  (a fixture)

from reliability_helpers import default_signals
from reliability_helpers import driver_env
from reliability_helpers import finished_checkpoints
from simigrad_jax.compile import exit_wait
from simigrad_jax.compile.compiler import CompileAbandoned
from simigrad_jax.compile.compiler import StepCompileError
from simigrad_jax.compile.compiler import StepCompiler
from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.step_functions import Program
from waiting import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRIES = 5

# A tiny adaptive Trainer whose batch grows every step, so that each step asks for the shapes
# near its own; after the first three, every compile first spends seconds inside XLA on a large
# program. When the training returns, one more compile is asked for; it waits until the
# interpreter's exit begins (the script's own exit hook, which runs before the compiles' wait),
# then stays inside XLA for at least 1.5 s, compiling large programs: so the exit always meets a
# compile inside XLA, for longer than the wait's quiet second, however fast or loaded the machine.
EXIT_SCRIPT = textwrap.dedent(
  """
  import atexit, os, sys, threading, time
  sys.path.insert(0, {tests!r})
  import simigrad_jax  # this checkout's (PYTHONPATH)
  os.environ.update(simigrad_jax.simulated_cpu_devices_env(8))
  import jax, jax.numpy as jnp
  from simigrad_jax.compile import compiler, exit_wait
  from tiny_run import trainer_objects, trainer_with

  real = compiler._compile
  count = [0]
  trained, entered, exiting = threading.Event(), threading.Event(), threading.Event()

  def heavy(x):
    for i in range(80):
      x = jnp.sin(x) * (i + 1.0) + jnp.cos(x @ x)
    return x

  def compile_heavy():
    count[0] += 1  # a new shape each time: never from JAX's caches
    shape = jax.ShapeDtypeStruct((8 + count[0], 8 + count[0]), jnp.float32)
    jax.jit(heavy).lower(shape).compile()

  def slow(lowered):
    if trained.is_set():  # the compile the exit meets
      print("compile in progress", flush=True)
      entered.set()
      exiting.wait()
      start = time.monotonic()
      while time.monotonic() - start < 1.5:
        compile_heavy()
    elif count[0] >= 3:
      compile_heavy()
    else:
      count[0] += 1
    return real(lowered)

  compiler._compile = slow
  controller = simigrad_jax.Controller(
    16, 0.95, batch_size_lower_bound=8, batch_size_upper_bound=112
  )
  trainer = trainer_with(**(trainer_objects({workdir!r}) | dict(
    controller=controller, max_micro_batch_size=16, progress=False, tensorboard=False,
  )))
  trainer.train(num_steps=8)
  trained.set()
  last = compiler.StepCompiler(
    lambda size: jax.jit(heavy).lower(jax.ShapeDtypeStruct((size, size), jnp.float32))
  )
  last.prefetch([5])
  entered.wait()
  atexit.register(exiting.set)  # runs first: registered after the compiles' wait
  print("in flight at exit:", exit_wait.IN_FLIGHT.in_progress, flush=True)
  """
)


@pytest.mark.slow
def test_a_script_that_returns_with_compiles_in_xla_exits_0(tmp_path):
  codes = []
  for index in range(TRIES):
    script = tmp_path / f"run{index}.py"
    script.write_text(
      EXIT_SCRIPT.format(tests=str(ROOT / "tests"), workdir=str(tmp_path / f"w{index}"))
    )
    done = subprocess.run(
      [sys.executable, str(script)], env=driver_env(), capture_output=True, text=True, timeout=600
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]  # was 134: "terminate called ..."
    in_flight = int(output.split("in flight at exit: ")[1].split()[0])
    assert in_flight >= 1 and "compile in progress" in done.stdout, output[-3000:]
    assert "in progress before exit" in done.stderr, output[-3000:]  # the exit waited for it
    codes.append(done.returncode)
  assert codes == [0] * TRIES


# The digits demo, small, its batch adapting over the shape grid (recompile mode): when the
# signal comes, the step programs of the shapes near the batch are compiling in the background.
DEMO = [
  "-m",
  "train",
  "--config",
  "train/configs/digits_demo.py",
  "--config.cnn_features=(4, 8)",
  "--config.cnn_dense=16",
  "--config.tensorboard=False",
  "--config.plot=False",
  "--config.progress=False",
]
# A bound only against a hang: the exit's time is measured, not asserted (docs/training_scripts.md).
EXIT_BOUND_SECONDS = 300


def _steps(workdir):
  metrics = workdir / "metrics.jsonl"
  lines = metrics.read_text().splitlines() if metrics.exists() else []
  return [json.loads(line)["step"] for line in lines if '"batch_size"' in line]


@pytest.mark.slow
def test_ctrl_c_while_shapes_compile_exits_with_its_checkpoint_whole(tmp_path):
  workdir = tmp_path / "run"
  command = [sys.executable, *DEMO, "--workdir", str(workdir)]
  env = driver_env() | {"SIMIGRAD_JAX_CACHE_DIR": str(tmp_path / "cache")}
  with open(tmp_path / "err", "w") as err:
    proc = subprocess.Popen(
      command,
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=err,
      text=True,
      preexec_fn=default_signals,
    )
  try:
    while len(_steps(workdir)) < 3:
      assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
      time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stopped = time.monotonic()
    out, _ = proc.communicate(timeout=EXIT_BOUND_SECONDS)
  finally:
    if proc.poll() is None:
      proc.kill()
  print(f"Ctrl-C to exit: {time.monotonic() - stopped:.1f} s")
  assert proc.returncode == 130, (tmp_path / "err").read_text()[-3000:]
  step = _steps(workdir)[-1]
  assert f"training stopped by SIGINT after step {step}" in out
  assert finished_checkpoints(workdir)[-1] == step
  # Whole: the next start restores it (its arrays checked against their checksums) and goes on.
  resumed = subprocess.run(
    command + [f"--config.num_steps={step + 1}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=EXIT_BOUND_SECONDS,
  )
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resuming from the checkpoint at step {step}" in resumed.stdout
  assert _steps(workdir) == list(range(1, step + 2))


@pytest.fixture
def in_flight(monkeypatch):
  """A fresh record of the compiles in flight, in place of the process's (whose exit hook must
  not run before the process ends)."""
  fresh = exit_wait._InFlight()
  monkeypatch.setattr(exit_wait, "IN_FLIGHT", fresh)
  yield fresh
  atexit.unregister(fresh.at_exit)  # (registered by its first compile)


def test_a_compile_asked_for_after_the_exit_began_is_not_started(mesh, in_flight):  # noqa: F811
  lower = Lowerer(mesh)
  with StepCompiler(lower) as step:
    step.get(1)
    in_flight.at_exit(io.StringIO())
    with pytest.raises(StepCompileError) as raised:
      step.get(2)
    assert isinstance(raised.value.__cause__, CompileAbandoned)
    assert "the process is exiting" in str(raised.value.__cause__)
    assert step.get(1) is not None  # a compiled one still runs
  assert lower.calls == [1]  # 2 was never lowered


def test_the_exit_cancels_queued_compiles_and_waits_for_the_one_in_progress(
  mesh,  # noqa: F811
  in_flight,
):
  lower = Lowerer(mesh, gated=[1])
  step = StepCompiler(lower)
  step.prefetch([1, 2, 4])
  assert lower.started[1].wait(TIMEOUT)  # 1 in progress, 2 and 4 queued
  stream = io.StringIO()
  returned = threading.Event()
  exiting = threading.Thread(
    target=lambda: (in_flight.at_exit(stream, quiet_seconds=0.1), returned.set())
  )
  exiting.start()
  wait_until(lambda: stream.getvalue(), TIMEOUT)
  assert stream.getvalue() == "simigrad: waiting for 1 compile in progress before exit\n"
  assert not returned.is_set()  # waits while the compile is in progress
  lower.gates[1].set()
  exiting.join(TIMEOUT)
  assert returned.is_set() and in_flight.in_progress == 0
  # The exit waits for XLA's compile; its thread marks the size done just after.
  wait_until(lambda: step.stats()["compiled_sizes"] == [1], TIMEOUT)
  assert lower.calls == [1]  # the queued ones never started


def test_the_exit_says_nothing_when_the_compiles_end_within_the_quiet_time(
  mesh,  # noqa: F811
  in_flight,
):
  lower = Lowerer(mesh, gated=[1])
  step = StepCompiler(lower)
  step.prefetch([1])
  assert lower.started[1].wait(TIMEOUT)

  # The gate opens once the exit has counted the compile in progress: a timer could open it, on
  # a loaded machine, before the exit began, and the exit would find no compile to wait for.
  def open_once_the_exit_began():
    wait_until(lambda: in_flight._exiting, TIMEOUT)
    time.sleep(0.05)
    lower.gates[1].set()

  threading.Thread(target=open_once_the_exit_began).start()
  stream = io.StringIO()
  assert in_flight.at_exit(stream, quiet_seconds=TIMEOUT) == 1
  assert stream.getvalue() == ""
  # The exit waits for XLA's compile; its thread marks the size done just after.
  wait_until(lambda: step.stats()["compiled_sizes"] == [1], TIMEOUT)


def test_after_a_stop_on_a_signal_the_exit_waits_for_no_compile(mesh, in_flight):  # noqa: F811
  lower = Lowerer(mesh, gated=[1])
  compilers = StepProgramCompiler(
    types.SimpleNamespace(lower=lambda key: lower(key.micro)), layout=None, background=True
  )
  compilers.set_interrupt(lambda: False)
  compilers.set_interrupt(None)  # a run that ended without a signal
  compilers.prefetch([(Program.FUSED, 1)])
  assert lower.started[1].wait(TIMEOUT)
  compilers.set_interrupt(lambda: True)
  compilers.set_interrupt(None)  # a run that stopped on a signal
  stream = io.StringIO()
  assert in_flight.at_exit(stream, quiet_seconds=0.1) == 1  # returns with it in progress
  assert stream.getvalue() == "" and in_flight.in_progress == 1
  lower.gates[1].set()
  wait_until(lambda: in_flight.in_progress == 0, TIMEOUT)
