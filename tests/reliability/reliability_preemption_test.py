"""Preemption: SIGTERM and SIGINT stop a run cleanly, and a checkpoint on time bounds a SIGKILL's cost.

A signal sent at a random step of a real run (tests/train_driver.py in a
subprocess, the signal sent from outside while it trains) must finish the
step under way, save and wait for its checkpoint, and exit 0 (SIGTERM); the
same command then resumes from that checkpoint, does every later step once
and no step twice, and ends with the parameters of a run that was never
interrupted. A second signal ends the process at once. With several
processes a signal to one of them stops all of them after the same step.
``python -m train`` exits 0 on SIGTERM and 130 on SIGINT, saying where it
stopped. ``checkpoint_every_seconds`` saves once that many seconds passed.

The signal's step is drawn from SIMIGRAD_RELIABILITY_SEED (tests/reliability_helpers.py).
"""

from __future__ import annotations

import pathlib
import pickle
import random
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

import simigrad_jax
from reliability_helpers import DRIVER
from reliability_helpers import DRIVER_TIMEOUT_SECONDS
from reliability_helpers import ROOT
from reliability_helpers import SEED
from reliability_helpers import attempts
from reliability_helpers import default_signals
from reliability_helpers import driver_env
from reliability_helpers import finished_checkpoints
from reliability_helpers import free_port
from reliability_helpers import read_trace
from reliability_helpers import run_driver
from reliability_helpers import step_records
from simigrad_jax.multihost import preemption
from tiny_run import trainer_objects

pytestmark = [
  pytest.mark.reliability,
  # ml_collections loads config files with importlib's deprecated load_module().
  pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning"),
]

STEPS = 16
# No checkpoint every so many steps: only the epoch's end (about step 12) and the signal's.
RUN = ("--steps", STEPS, "--checkpoint-every", 0)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  return tmp_path_factory.mktemp("compile_cache")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, compile_cache):
  """The uninterrupted run: its metrics records and final parameters."""
  workdir = tmp_path_factory.mktemp("straight")
  result = run_driver(workdir, *RUN, "--compile-cache", compile_cache)
  assert result.returncode == 0, result.stderr[-3000:]
  return step_records(workdir), _final_params(workdir)


def _final_params(workdir, process=0):
  return [
    np.asarray(leaf)
    for leaf in [e for e in read_trace(workdir, process) if e["event"] == "end"][-1]["params"]
  ]


class Driver:
  """tests/train_driver.py running in the background, its output in files beside ``workdir``."""

  def __init__(self, workdir: pathlib.Path, *args, process: int = 0):
    self.workdir, self.process = workdir, process
    self._out = workdir.parent / f"{workdir.name}.{process}.out"
    self._err = workdir.parent / f"{workdir.name}.{process}.err"
    with open(self._out, "w") as out, open(self._err, "w") as err:
      self.proc = subprocess.Popen(
        [sys.executable, str(DRIVER), "--workdir", str(workdir), *map(str, args)],
        env=driver_env(),
        stdout=out,
        stderr=err,
        preexec_fn=default_signals,
      )

  def wait_for(self, event_matches) -> dict:
    """The first trace event for which ``event_matches(event)``, polling while the driver runs."""
    deadline = time.monotonic() + DRIVER_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
      for event in read_trace(self.workdir, self.process):
        if event_matches(event):
          return event
      if self.proc.poll() is not None:
        raise AssertionError(
          f"the driver ended (rc {self.proc.returncode}) before the event: {self.stderr()[-3000:]}"
        )
      time.sleep(0.02)
    self.proc.kill()
    raise AssertionError("the driver did not reach the event in time")

  def wait_for_step(self, step: int) -> None:
    self.wait_for(lambda e: e["event"] == "step" and e["step"] >= step)

  def signal(self, signum: int) -> None:
    self.proc.send_signal(signum)

  def returncode(self) -> int:
    try:
      return self.proc.wait(timeout=DRIVER_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      raise

  def stdout(self) -> str:
    return self._out.read_text()

  def stderr(self) -> str:
    return self._err.read_text()


def _preempted(workdir, process=0) -> list[dict]:
  return [e for e in read_trace(workdir, process) if e["event"] == "preempted"]


def test_sigterm_saves_the_step_under_way_and_the_resume_redoes_no_step(
  straight, compile_cache, tmp_path
):
  straight_records, straight_params = straight
  at = random.Random(SEED).randrange(2, STEPS - 4)
  workdir = tmp_path / "run"
  # The steps after `at` take well under a second: the run waits at step STEPS - 2 for the signal,
  # so that one sent late (a loaded machine) stops it before its end all the same.
  driver = Driver(workdir, *RUN, "--compile-cache", compile_cache, "--hold-for-signal", STEPS - 2)
  driver.wait_for_step(at)
  driver.signal(signal.SIGTERM)
  assert driver.returncode() == 0, driver.stderr()[-3000:]  # a clean stop, as schedulers expect

  [stop] = _preempted(workdir)
  trained = [e["step"] for e in read_trace(workdir) if e["event"] == "step"]
  assert stop["signal"] == "SIGTERM" and stop["saved"]
  assert stop["step"] == trained[-1] >= at  # the step under way was finished, and saved
  assert finished_checkpoints(workdir)[-1] == stop["step"]
  assert f"training stopped by SIGTERM after step {stop['step']}" in driver.stdout()
  assert "SIGTERM received: finishing the step under way" in driver.stderr()
  assert [r["step"] for r in step_records(workdir)] == trained  # every record up to it

  resumed = run_driver(workdir, *RUN, "--compile-cache", compile_cache)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  first, second = attempts(read_trace(workdir))
  assert second["start"]["step"] == stop["step"]
  # No step done twice, none left out, and the same run as one never interrupted.
  assert [e["step"] for e in first["steps"] + second["steps"]] == list(range(1, STEPS + 1))
  records = step_records(workdir)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  for key in ("batch_size", "lr_factor", "next_batch_size", "examples_seen", "decision"):
    assert [r[key] for r in records] == [r[key] for r in straight_records], key
  np.testing.assert_allclose(
    [r["loss"] for r in records], [r["loss"] for r in straight_records], rtol=0, atol=1e-6
  )
  for got, want in zip(_final_params(workdir), straight_params):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
  print(f"\nSIGTERM sent at step {at}, stopped after step {stop['step']}")


def test_a_second_signal_ends_the_process_at_once(compile_cache, tmp_path):
  """Ctrl-C twice: the first starts the checkpoint (held for a minute here), the second ends the
  process by SIGINT's default action at once, without it."""
  workdir = tmp_path / "run"
  driver = Driver(workdir, *RUN, "--compile-cache", compile_cache, "--slow-save", 60)
  driver.wait_for_step(2)
  driver.signal(signal.SIGINT)
  saving = driver.wait_for(lambda e: e["event"] == "saving")
  sent = time.monotonic()
  driver.signal(signal.SIGINT)
  assert driver.returncode() == -signal.SIGINT
  assert time.monotonic() - sent < 30  # not after the minute of the save (loose: CI is loaded)
  assert saving["step"] not in finished_checkpoints(workdir) and not _preempted(workdir)


def test_a_signal_to_one_process_stops_every_process_after_the_same_step(compile_cache, tmp_path):
  """Two processes (jax.distributed, 4 CPU devices each); only process 1 gets the SIGTERM."""
  workdir = tmp_path / "run"
  coordinator = f"127.0.0.1:{free_port()}"
  drivers = [
    Driver(
      workdir,
      *RUN,
      "--num-processes",
      2,
      "--process-id",
      p,
      "--coordinator",
      coordinator,
      "--compile-cache",
      compile_cache,
      # Process 1 waits at step STEPS - 2 for the signal, so that one sent late (a loaded
      # machine) stops the run before its end all the same; process 0 waits in the next step's
      # collective meanwhile.
      *(("--hold-for-signal", STEPS - 2) if p == 1 else ()),
      process=p,
    )
    for p in (0, 1)
  ]
  try:
    drivers[1].wait_for_step(3)
    drivers[1].signal(signal.SIGTERM)
    codes = [driver.returncode() for driver in drivers]
  finally:
    for driver in drivers:
      if driver.proc.poll() is None:
        driver.proc.kill()
  assert codes == [0, 0], [driver.stderr()[-2000:] for driver in drivers]
  stops = [_preempted(workdir, p) for p in (0, 1)]
  assert [len(s) for s in stops] == [1, 1]
  assert stops[0][0]["step"] == stops[1][0]["step"] >= 3 and stops[0][0]["signal"] == "SIGTERM"
  steps = [[e["step"] for e in read_trace(workdir, p) if e["event"] == "step"] for p in (0, 1)]
  assert steps[0] == steps[1] and steps[0][-1] == stops[0][0]["step"]
  assert finished_checkpoints(workdir)[-1] == stops[0][0]["step"]


# The digits demo at a size that compiles once and trains an epoch in about a second (as
# tests/train_main_test.py); stopped by the signal after its second step, it is given 30 epochs so
# that a signal sent late (a loaded machine) still finds it training.
SMALL = [
  "--config.mode=pad",
  "--config.cnn_features=(4, 8)",
  "--config.cnn_dense=16",
  "--config.tensorboard=False",
  "--config.num_epochs=30",
  "--config.plot=False",
]


@pytest.mark.parametrize(
  "signum, exit_code",
  [(signal.SIGTERM, 0), (signal.SIGINT, 130), (signal.SIGHUP, 129)],
  ids=["SIGTERM", "SIGINT", "SIGHUP"],
)
def test_python_m_train_stops_with_a_message_and_the_schedulers_exit_code(
  signum, exit_code, compile_cache, tmp_path
):
  workdir = tmp_path / "run"
  env = driver_env()
  with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
    proc = subprocess.Popen(
      [
        sys.executable,
        "-m",
        "train",
        "--config",
        "train/configs/digits_demo.py",
        "--workdir",
        str(workdir),
        *SMALL,
        f"--config.compilation_cache_dir={compile_cache / 'train'}",
      ],
      cwd=ROOT,
      env=env,
      stdout=out,
      stderr=err,
      preexec_fn=default_signals,
    )
  try:
    deadline = time.monotonic() + DRIVER_TIMEOUT_SECONDS
    while len(step_records(workdir) if (workdir / "metrics.jsonl").exists() else []) < 2:
      assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
      assert time.monotonic() < deadline, "no step within the timeout"
      time.sleep(0.05)
    proc.send_signal(signum)
    code = proc.wait(timeout=DRIVER_TIMEOUT_SECONDS)
  finally:
    if proc.poll() is None:
      proc.kill()
  out = (tmp_path / "out").read_text()
  assert code == exit_code, (tmp_path / "err").read_text()[-3000:]
  step = step_records(workdir)[-1]["step"]
  assert (
    f"training stopped by {signal.Signals(signum).name} after step {step}; its checkpoint "
    f"is saved in {workdir / 'checkpoints' / str(step)}"
  ) in out
  assert finished_checkpoints(workdir)[-1] == step
  assert not (workdir / "summary.json").exists()  # the run is not over: no final report


def test_checkpoint_every_seconds_saves_once_that_many_seconds_passed(tmp_path):
  """Every step's bookkeeping takes 0.3 s: a checkpoint every 1 s comes every 3 to 5 steps, each at
  least 1 s after the one before (a fixed batch of 8 of the 120 examples: no epoch ends)."""

  def slow_step(record):
    assert not record.epoch_end
    time.sleep(0.3)

  saves = []
  objects = trainer_objects(tmp_path)
  objects["controller"] = simigrad_jax.Controller(
    8, 0.5, batch_size_lower_bound=8, batch_size_upper_bound=16, enable_adjust=False
  )
  with simigrad_jax.Trainer(
    **objects,
    hooks=[SimpleNamespace(on_step=slow_step)],
    config=simigrad_jax.TrainerConfig(
      max_micro_batch_size=4,
      seed=3,
      progress=False,
      tensorboard=False,
      checkpoints=simigrad_jax.CheckpointConfig(every_seconds=1.0, max_to_keep=30),
    ),
  ) as trainer:
    save = trainer._checkpoints.checkpointer.save

    def timed_save(step, state, host):
      saves.append((step, time.monotonic()))
      save(step, state, host)

    trainer._checkpoints.checkpointer.save = timed_save
    saves.append((0, time.monotonic()))  # the start of the train call
    trainer.train(num_steps=14)
    assert trainer._checkpoints.checkpointer.all_steps() == [step for step, _ in saves[1:]]
  assert saves[-1][0] == 14  # the end of the run
  on_time = saves[:-1]
  assert len(on_time) >= 4, saves  # the start and three or more on time
  for (previous, before), (step, t) in zip(on_time, on_time[1:]):
    assert t - before >= 1.0, (step, t - before)
    assert step - previous <= 5, saves
  print(
    f"\ncheckpoints on time at steps {[step for step, _ in on_time[1:]]}, "
    f"{[round(b - a, 2) for (_, a), (_, b) in zip(on_time, on_time[1:])]} s apart"
  )


def test_every_process_reads_the_same_outcome_from_the_step_reports():
  """One process's signal stops all; the clock for checkpoints on time is process 0's."""
  reports = [
    {"signal": None, "since_checkpoint": 12.5, "failed_save": None},
    {"signal": "SIGINT", "since_checkpoint": 30.0, "failed_save": None},
    {"signal": "SIGTERM", "since_checkpoint": 0.1, "failed_save": "OSError: disk full"},
  ]
  assert preemption.Agreed.read(reports) == ("SIGINT", 12.5, [None, None, "OSError: disk full"])
  assert preemption.Agreed.read(reports[:1]) == (None, 12.5, [None])
  stop = pickle.loads(pickle.dumps(simigrad_jax.Preempted("SIGINT", 7, "/run/checkpoints/7", {})))
  assert (stop.signal, stop.step, stop.exit_code) == (signal.SIGINT, 7, 130)
  assert simigrad_jax.Preempted("SIGTERM", 7, "/run/checkpoints/7", {}).exit_code == 0


# Its standard output and error are the terminal that hangs up, so an error is written to the
# file named by its second argument instead.
HANG_UP = """
import os, pty, signal, sys, threading, traceback
from simigrad_jax.multihost import preemption
try:
  # As in a terminal's session: a test run under nohup hands SIGHUP down ignored, and
  # StopSignals leaves an ignored signal ignored.
  signal.signal(signal.SIGHUP, signal.SIG_DFL)
  master, slave = pty.openpty()
  for fd in (1, 2):
    os.dup2(slave, fd)
  with preemption.StopSignals() as signals:
    os.close(master)  # the terminal hangs up: writes to it fail from now on
    # To this thread, whose handler then runs before the call returns (os.kill may hand the
    # signal to another of the process's threads, and the handler would run some time later).
    signal.pthread_kill(threading.get_ident(), signal.SIGHUP)
    print("a progress bar after the hang-up " * 100, flush=True)
    print("and a warning", file=sys.stderr, flush=True)
  with open(sys.argv[1], "w") as done:
    done.write(signals.received.name)
except BaseException:
  with open(sys.argv[2], "w") as error:
    traceback.print_exc(file=error)
  raise
"""


def test_a_hang_up_is_a_stop_and_the_terminal_it_closed_takes_no_more_output(tmp_path):
  """SIGHUP (a closed terminal, a dropped SSH session) stops as SIGTERM does; the writes after
  it, to the terminal that is gone, fail without it, so the stop could not finish and save."""
  done, error = tmp_path / "done", tmp_path / "error"
  result = subprocess.run(
    [sys.executable, "-c", HANG_UP, str(done), str(error)],
    env=driver_env(),
    capture_output=True,
    text=True,
    timeout=DRIVER_TIMEOUT_SECONDS,
    check=False,
  )
  assert result.returncode == 0, error.read_text() if error.exists() else result.stderr[-3000:]
  assert done.read_text() == "SIGHUP"
  assert signal.SIGHUP in preemption.SIGNALS
  assert simigrad_jax.Preempted("SIGHUP", 7, "/run/checkpoints/7", {}).exit_code == 129
