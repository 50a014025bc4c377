"""benchmarks/trainer_overhead/switching.py's runs: one mode's Trainer in this process, or in several local ones.

Each mode trains the same rule-paced sweep of batch sizes
(:func:`benchmarks.trainer_overhead.switching.rule_sweep`) with :class:`simigrad_jax.Trainer`
and returns the numbers :mod:`benchmarks.trainer_overhead.switching_report` summarises. A
multi-process mode starts the script once per process on 127.0.0.1
(:mod:`benchmarks.local_processes`); an untimed primer run pays a process's
one-time costs first.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import tempfile
import time
from typing import Any

import jax
import numpy as np

import simigrad_jax
from benchmarks import local_processes
from benchmarks.trainer_overhead import switching_report
from benchmarks.trainer_overhead.switching_models import AXIS
from benchmarks.trainer_overhead.switching_models import MODELS
from benchmarks.trainer_overhead.switching_models import init_params
from benchmarks.trainer_overhead.switching_models import make_loss_fn
from benchmarks.trainer_overhead.switching_models import make_optimizer

MULTI_PROCESS_MODES = {"recompile_2proc": ("recompile", 2)}  # mode: (the mode it runs, processes)
PROCESS_TIMEOUT_SECONDS = 1800  # a multi-process mode's processes are killed after this


def prime_process(
  model_name: str,
  data: dict[str, np.ndarray],
  root: pathlib.Path,
  workdir: pathlib.Path | None = None,
) -> float:
  """Runs a throwaway 2-step Trainer (pad mode, 1 row per device), untimed; returns its seconds.

  The first Trainer of a process pays one-time costs (Flax's first init of
  the model, eager ops compiled once per process, orbax's first save of the
  state's structure) that would otherwise be charged to whichever mode runs
  first. Its one compiled shape (1 row per device, pad mode) is not reused:
  every Trainer lowers and compiles its own steps ahead of time. Its workdir
  is a new directory under ``root`` unless ``workdir`` is given (the
  processes of a multi-process run share one).
  """
  start = time.perf_counter()
  params = init_params(model_name, data)
  controller = simigrad_jax.Controller(8, 0.1, batch_size_lower_bound=8, batch_size_upper_bound=8)
  workdir = workdir or pathlib.Path(tempfile.mkdtemp(prefix="primer-", dir=root))
  with simigrad_jax.Trainer(
    loss_fn=make_loss_fn(MODELS[model_name]()),
    params=params,
    optimizer=make_optimizer(),
    source=simigrad_jax.ArraySource(data),
    controller=controller,
    workdir=workdir,
    config=simigrad_jax.TrainerConfig(
      max_micro_batch_size=1,
      tensorboard=False,
      progress=False,
      axis_name=AXIS,
      compile=simigrad_jax.CompileConfig(mode="pad"),
    ),
  ) as trainer:
    trainer.train(num_steps=2)
  shutil.rmtree(workdir, ignore_errors=True)
  return time.perf_counter() - start


def run_mode(
  mode: str,
  *,
  data: dict[str, np.ndarray],
  schedule: list[int],
  lower: int,
  upper: int,
  max_micro: int,
  model_name: str,
  workdir: pathlib.Path,
  persistent_cache: str | None,
  steps_per_compile: float | None = None,
  seed: int = 0,
  shapes_per_step: int | None = None,
) -> dict[str, Any] | None:
  """Trains ``len(schedule)`` steps in one mode; returns its numbers (None on process > 0).

  ``steps_per_compile``: the compile schedule's steps per program (None: the Trainer's default).
  ``shapes_per_step``: steps of up to this many shapes, on the grid the Trainer chooses for them
  (``shapes_per_octave=None``, as the training scripts run); None: one shape a step, on the grid
  of halvings.
  """
  model = MODELS[model_name]()
  # Flax's first init of a model runs many small eager ops that compile once
  # per process (about 1.5 s for the CNN): not part of the measured set-up.
  params = init_params(model_name, data, seed)
  total_start = time.perf_counter()
  optimizer = make_optimizer()
  controller = simigrad_jax.Controller(
    schedule[0],
    similarity_target=0.1,
    batch_size_lower_bound=lower,
    batch_size_upper_bound=upper,
    batch_sizes_to_profile=schedule,
  )
  trainer = simigrad_jax.Trainer(
    loss_fn=make_loss_fn(model),
    params=params,
    optimizer=optimizer,
    source=simigrad_jax.ArraySource(data),
    controller=controller,
    workdir=workdir,
    config=simigrad_jax.TrainerConfig(
      max_micro_batch_size=max_micro,
      seed=seed,
      tensorboard=False,
      progress=False,
      axis_name=AXIS,
      compile=simigrad_jax.CompileConfig(
        mode="pad" if mode == "pad" else "recompile",
        min_micro_batch_size=1,
        # The grid of halvings, its shapes listed in switching.py; or the Trainer's choice for
        # steps of several shapes.
        shapes_per_octave=1 if shapes_per_step is None else None,
        shapes_per_step=shapes_per_step or 1,
        fallback=mode != "recompile_wait",
        cache_dir=persistent_cache,
        **({} if steps_per_compile is None else {"steps_per_compile": steps_per_compile}),
      ),
    ),
  )
  setup = time.perf_counter() - total_start
  apply_compile_seconds = trainer.compile_stats()["compile_seconds"]  # nothing else compiled yet
  try:
    train_start = time.perf_counter()
    summary = trainer.train(num_steps=len(schedule))
    train = time.perf_counter() - train_start
  finally:
    close_start = time.perf_counter()
    trainer.close()
    close = time.perf_counter() - close_start
  final_stats = trainer.compile_stats()
  timings = {
    "setup": setup,
    "train": train,
    "close": close,
    "total": time.perf_counter() - total_start,
    "apply_compile": apply_compile_seconds,
  }
  if jax.process_index() != 0:
    return None  # process 0 writes the metrics
  records = simigrad_jax.read_metrics(workdir / "metrics.jsonl")
  return switching_report.summarize_mode(
    mode, records, summary, final_stats, trainer.shapes, timings
  )


def run_processes_mode(
  mode: str, args: argparse.Namespace, root: pathlib.Path, num_devices: int, script: str
) -> tuple[dict[str, Any], pathlib.Path]:
  """Runs a multi-process mode: ``script`` (switching.py) in each process, on its share of the devices.

  Every process runs the same sweep in one shared workdir; process 0 writes
  the mode's numbers. Returns them and the workdir (with each process's
  log). Raises RuntimeError, with each process's last output, when a
  process fails or runs past :data:`PROCESS_TIMEOUT_SECONDS`.
  """
  base_mode, num_processes = MULTI_PROCESS_MODES[mode]
  if num_devices % num_processes:
    raise ValueError(
      f"{mode} splits the {num_devices} devices over {num_processes} processes: "
      f"give a device count divisible by {num_processes}"
    )
  workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=root))
  command = [
    script,
    "--modes",
    base_mode,
    "--steps",
    args.steps,
    "--lower",
    args.lower,
    "--upper",
    args.upper,
    "--max-micro-batch-size",
    args.max_micro_batch_size,
    "--model",
    args.model,
    "--workdir",
    workdir,
  ]
  if args.persistent_cache:
    command += ["--persistent-cache", args.persistent_cache]
  if args.steps_per_compile is not None:
    command += ["--steps-per-compile", args.steps_per_compile]
  if args.shapes_per_step is not None:
    command += ["--shapes-per-step", args.shapes_per_step]
  result = local_processes.run_local_processes(
    command,
    num_processes=num_processes,
    devices_per_process=num_devices // num_processes,
    workdir=workdir,
    timeout=PROCESS_TIMEOUT_SECONDS,
    what=mode,
  )
  result.update({"processes": num_processes, "devices_per_process": num_devices // num_processes})
  return result, workdir
