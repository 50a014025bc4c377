"""Kill and resume: SIGKILL a training run at random points, resume it, compare with an uninterrupted run.

Each scenario runs tests/train_driver.py (20 adaptive steps, 600 examples, so
the run crosses an epoch boundary; a checkpoint every 3 steps and at the end
of the epoch) in subprocesses that SIGKILL themselves at the chosen points:
between steps, right after a checkpoint was handed to orbax's asynchronous
save (its temporary folder still being written), and inside a background
compile of the StepCompiler. After the kills the run is resumed until done and
compared with an uninterrupted run: the same batch sizes, learning rates,
decisions and examples at every step, losses within 1e-5, and the only
examples trained twice are those of the steps after the checkpoint each
resume started from (the newest finished checkpoint at that moment).

The scenarios run on 8 devices (the device split); two more run on 3 devices
and on 1 (the local split: each device's rows in two halves). Two read the
rows through a GrainSource with a worker process decoding ahead (killed
between steps, and during a save) and must match the uninterrupted run that
reads them from memory.

The kill points are drawn from SIMIGRAD_RELIABILITY_SEED (tests/reliability_helpers.py).
"""

from __future__ import annotations

import collections
import fcntl
import os
import random
import shutil

import numpy as np
import pytest

import simigrad_jax
from reliability_helpers import SEED
from reliability_helpers import attempts
from reliability_helpers import finished_checkpoints
from reliability_helpers import read_trace
from reliability_helpers import run_driver
from reliability_helpers import step_records

pytestmark = pytest.mark.reliability

STEPS = 20
NUM_EXAMPLES, SAMPLER_SEED = 600, 1  # the driver's data set and seed
COMPARED = (
  "batch_size",
  "lr_factor",
  "next_batch_size",
  "next_lr_factor",
  "decision",
  "examples_seen",
  "micro_batch_size",
  "accumulation_steps",
  "schedule_factor",
)


def _scenarios() -> dict[str, tuple[int, list[list[str]]]]:
  """Named kill sequences: the device count, and the driver arguments of each killed run."""
  rng = random.Random(SEED)
  saves = list(range(3, STEPS, 3))
  between = rng.randrange(1, STEPS)
  in_save = rng.choice(saves)
  # A run compiles two micro-step programs (fused, micro) off the main thread: kill in either.
  job = rng.choice([1, 2])
  chain_kill = rng.randrange(2, 8)
  chain_save = rng.choice([s for s in saves if s > chain_kill])
  chain_last = rng.randrange(chain_save + 1, STEPS)
  chain_job = rng.choice([1, 2])
  local_kill, local_save = rng.randrange(1, STEPS), rng.choice(saves)
  grain_kill, grain_save = rng.randrange(1, STEPS), rng.choice(saves)
  return {
    f"between-steps-{between}": (8, [["--kill-at", between]]),
    f"in-save-{in_save}": (8, [["--kill-in-save", in_save]]),
    f"in-compile-job{job}": (8, [["--kill-in-compile", job]]),
    # Four kills of one run: between steps, during a save, during the resumed run's
    # background compile, and between steps again.
    f"chain-{chain_kill}-save{chain_save}-compile{chain_job}-{chain_last}": (
      8,
      [
        ["--kill-at", chain_kill],
        ["--kill-in-save", chain_save],
        ["--kill-in-compile", chain_job],
        ["--kill-at", chain_last],
      ],
    ),
    f"3-devices-between-steps-{local_kill}": (3, [["--kill-at", local_kill]]),
    f"1-device-in-save-{local_save}": (1, [["--kill-in-save", local_save]]),
    f"grain-workers-between-steps-{grain_kill}-save{grain_save}": (
      8,
      [["--kill-at", grain_kill], ["--kill-in-save", grain_save]],
    ),
  }


GRAIN = ["--grain-workers", 1]  # the run's rows through a GrainSource and a worker process
SCENARIOS = _scenarios()
KIND = {"--kill-at": "between_steps", "--kill-in-save": "save", "--kill-in-compile": "compile"}


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  return tmp_path_factory.mktemp("compile_cache")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, compile_cache):
  """``get(num_devices)``: the uninterrupted run, made once per test session and device count
  (shared by pytest-xdist workers)."""
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    shared = shared.parent  # this session's folder, the same for every xdist worker
  return lambda num_devices: _straight_run(shared, compile_cache, num_devices)


def _straight_run(shared, compile_cache, num_devices):
  workdir = shared / f"reliability_kill_straight{num_devices}"
  with open(shared / f"reliability_kill_straight{num_devices}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (workdir / "done").exists():
      shutil.rmtree(workdir, ignore_errors=True)
      result = run_driver(
        workdir, "--steps", STEPS, "--compile-cache", compile_cache, "--devices", num_devices
      )
      assert result.returncode == 0, result.stderr[-3000:]
      (workdir / "done").write_text("")
  records = step_records(workdir)
  steps = {e["step"]: e for e in read_trace(workdir) if e["event"] == "step"}
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  assert records[-1]["examples_seen"] > NUM_EXAMPLES  # the run crosses an epoch boundary
  assert len({r["batch_size"] for r in records}) >= 5  # and the batch size moves
  return records, steps


def _ordered_examples(event: dict) -> list[tuple[int, int]]:
  """``(epoch, example)`` of every example a logged step trained, from the sampler's order."""
  sampler = simigrad_jax.data.EpochSampler(NUM_EXAMPLES, SAMPLER_SEED)
  first = event["examples_seen"] - event["batch_size"]
  indices = sampler.indices_at(first, event["batch_size"])
  assert sorted(indices.tolist()) == event["indices"], (
    f"step {event['step']} trained other examples"
  )
  return [((first + i) // NUM_EXAMPLES, int(x)) for i, x in enumerate(indices)]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_killed_run_resumes_exactly(name, straight, compile_cache, tmp_path):
  num_devices, stages = SCENARIOS[name]
  straight_records, straight_steps = straight(num_devices)
  common = (
    "--steps",
    STEPS,
    "--compile-cache",
    compile_cache,
    "--devices",
    num_devices,
    *(GRAIN if name.startswith("grain") else ()),
  )
  restore_expected = []  # per resume: the newest finished checkpoint when it started
  for i, stage in enumerate(stages):
    if i:
      restore_expected.append((finished_checkpoints(tmp_path) or [0])[-1])
    killed = run_driver(tmp_path, *common, *stage)
    assert killed.returncode == -9, (
      f"{stage}: not killed (rc {killed.returncode}): {killed.stderr[-2000:]}"
    )
  restore_expected.append((finished_checkpoints(tmp_path) or [0])[-1])
  resumed = run_driver(tmp_path, *common)
  assert resumed.returncode == 0, resumed.stderr[-3000:]

  # The metrics file reads like the uninterrupted run's: every step once, same decisions.
  records = step_records(tmp_path)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  for key in COMPARED:
    assert [r[key] for r in records] == [r[key] for r in straight_records], key
  np.testing.assert_allclose(
    [r["loss"] for r in records], [r["loss"] for r in straight_records], rtol=0, atol=1e-5
  )

  runs = attempts(read_trace(tmp_path))
  assert len(runs) == len(stages) + 1
  final, redone = {}, []
  for i, run in enumerate(runs):
    start = run["start"]["step"]
    trained = [e["step"] for e in run["steps"]]
    assert trained == list(
      range(start + 1, start + 1 + len(trained))
    )  # contiguous from the restore
    if i < len(stages):  # killed where it was told to
      assert run["kill"] is not None and run["kill"]["kind"] == KIND[stages[i][0]], run["kill"]
      if run["kill"]["kind"] == "save":
        assert run["kill"]["tmp_dirs"], "the save had finished: the kill was not during the save"
      last = trained[-1] if trained else start
      restored = runs[i + 1]["start"]["step"]
      assert restored == restore_expected[i]  # the newest checkpoint that had finished
      assert restored <= last
      redone += [e for e in run["steps"] if e["step"] > restored]  # trained again after the resume
    for event in run["steps"]:
      final[event["step"]] = event

  # The same examples at every step (so in every epoch) as the uninterrupted run ...
  assert sorted(final) == list(range(1, STEPS + 1))
  for step, event in final.items():
    assert event["indices"] == straight_steps[step]["indices"], step
    for key in ("batch_size", "next_batch_size", "decision"):
      assert event[key] == straight_steps[step][key]
  # ... and no example trained twice in an epoch but those of the steps after each restore.
  once = collections.Counter(x for e in final.values() for x in _ordered_examples(e))
  assert max(once.values()) == 1  # within an epoch, every example once
  everything = collections.Counter(
    x for run in runs for e in run["steps"] for x in _ordered_examples(e)
  )
  again = collections.Counter(x for e in redone for x in _ordered_examples(e))
  assert everything == once + again
  for e in redone:  # a redone step trained exactly what the resumed run trained at that step
    assert e["indices"] == final[e["step"]]["indices"]
  kills = [
    f"{run['kill']['kind']}@{run['kill'].get('step', run['start']['step'])}" for run in runs[:-1]
  ]
  print(
    f"\n{name}: kills {kills}, restored from {[run['start']['step'] for run in runs[1:]]}, "
    f"examples trained twice {sum(again.values())}"
  )
