"""The Pareto benchmarks' protocol: run specs, the grid of runs, one run's record, reusing runs.

Shared by every task of ``benchmarks/pareto/pareto.py``. A task provides an
experiment (``make_trainer``, ``eval_fn``, ``num_train``, ``epochs``, ``root``,
``keep_workdirs``); :func:`train_run` trains one :class:`RunSpec` with it and
returns the run's JSON record.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import pathlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import simigrad_jax
from benchmarks.pareto.analysis import SIMIGRAD_GRID_KEYS
from simigrad_jax.compile import persistent_cache_settings
from simigrad_jax.controllers import OneStepLateController

# A run option that is no controller option: 1 wraps the controller in OneStepLateController.
ONE_STEP_LATE = "one_step_late"

LR_SCHEDULES = ("cosine", "step", "constant", "warmup_cosine")

# Keys every run in the JSON has (machine-read), with their types.
RUN_KEYS = {
  "controller": str,
  "seed": int,
  "test_accuracy": float,
  "avg_batch_size": float,
  "steps": int,
  "wall_seconds": float,
  "settings": dict,
}


def lr_schedule_fn(name: str, epochs: float) -> Callable[[float], float]:
  """A learning-rate multiplier as a function of the epochs trained (always > 0)."""
  if name == "constant":
    return lambda e: 1.0
  if name == "step":  # x0.1 at 50% and again at 75% of training
    return lambda e: 1.0 if e < 0.5 * epochs else 0.1 if e < 0.75 * epochs else 0.01
  cosine = lambda e: 0.02 + 0.98 * 0.5 * (1.0 + math.cos(math.pi * min(e / epochs, 1.0)))  # noqa: E731
  if name == "cosine":  # from 1 to 0.02
    return cosine
  if name == "warmup_cosine":  # linear from 0.02 to 1 over the first 10%, then cosine to 0.02
    return lambda e: (
      max(0.02, min(1.0, e / (0.1 * epochs)))
      if e < 0.1 * epochs
      else cosine((e - 0.1 * epochs) / 0.9)
    )
  raise ValueError(f"--lr-schedule must be one of {LR_SCHEDULES}, got {name!r}")


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One training run: a controller by name with its options, a learning rate and a seed."""

  controller: str
  options: tuple[tuple[str, Any], ...]
  lr: float
  lr_multiplier: float
  seed: int
  lr_rule: str = "sqrt"  # how the trainer scales the lr as the batch moves from B_0
  lr_coupling: str = "full"  # how that factor meets the schedule (TrainerConfig.lr.coupling)

  def settings_dict(self) -> dict[str, Any]:
    """The run's settings in a result's JSON (``lr_coupling`` only where not ``"full"``)."""
    return {
      **dict(self.options),
      "learning_rate": self.lr,
      "lr_multiplier": self.lr_multiplier,
      "lr_rule": self.lr_rule,
      **({} if self.lr_coupling == "full" else {"lr_coupling": self.lr_coupling}),
    }

  def label(self) -> str:
    o = dict(self.options)
    if self.controller == "fixed":
      return f"B={o['initial_batch_size']}"
    if self.controller == "simigrad":
      extra = "".join(f" {k}={v:g}" for k, v in self.options if k not in SIMIGRAD_GRID_KEYS)
      return (
        f"s={o['similarity_target']:g}{extra} [{o['batch_size_lower_bound']},"
        f"{o['batch_size_upper_bound']}]"
      )
    if self.controller == "gns":
      return f"m={o['multiple']:g} [{o['batch_size_lower_bound']},{o['batch_size_upper_bound']}]"
    if self.controller == "allowance":
      return (
        f"a={o['token_allowance']:g} [{o.get('batch_size_lower_bound')},"
        f"{o.get('batch_size_upper_bound')}]"
      )
    if self.controller in ("linear", "geometric"):
      return f"{o['initial_batch_size']}->{o['final_batch_size']}"
    if self.controller == "loss_plateau":
      return f"x{o['factor']:g} <= {o['batch_size_upper_bound']}"
    return ",".join(f"{k}={v}" for k, v in self.options)


def benchmark_trainer(
  controller: Any,
  workdir: pathlib.Path,
  cache_dir: pathlib.Path,
  *,
  seed: int,
  lr: simigrad_jax.LearningRateConfig,
  compile: simigrad_jax.CompileConfig | None = None,
  measure_every: int = 1,
  **trainer_args: Any,
) -> simigrad_jax.Trainer:
  """A Trainer with the comparisons' run settings and the task's own.

  Every task's runs hold a step in one micro-batch up to the controller's upper
  bound, keep one checkpoint (none saved on time), share the task's
  compilation cache and show no progress bar or TensorBoard events.

  Args:
    controller: the run's batch-size controller.
    workdir: the run's workdir.
    cache_dir: the task's compilation cache, shared by its runs.
    seed: the run's seed (``TrainerConfig.seed``).
    lr: how the learning rate follows the batch size (``TrainerConfig.lr``).
    compile: the task's compile settings (``TrainerConfig.compile``; None: the
      Trainer's defaults), their ``cache_dir`` set to ``cache_dir``.
    measure_every: ``TrainerConfig.measure_every``: the similarity measured on
      every ``measure_every``-th step, plain steps between.
    **trainer_args: the Trainer's other arguments (``loss_fn``, ``params``,
      ``optimizer``, ``source``, ...).

  Returns:
    The Trainer.
  """
  upper = simigrad_jax.controllers.batch_size_bounds(controller)[1] or controller.batch_size
  compile = compile or simigrad_jax.CompileConfig()
  config = simigrad_jax.TrainerConfig(
    max_micro_batch_size=max(1, -(-upper // jax.device_count())),
    seed=seed,
    progress=False,
    tensorboard=False,
    compile=compile.replace(cache_dir=cache_dir),
    checkpoints=simigrad_jax.CheckpointConfig(max_to_keep=1),
    lr=lr,
    measure_every=measure_every,
  )
  return simigrad_jax.Trainer(controller=controller, workdir=workdir, config=config, **trainer_args)


def token_model_params(model: Any, seq_length: int) -> Callable[[int], Any]:
  """A token model's initial parameters by seed, as NumPy arrays.

  Args:
    model: a Flax module taking ``[batch, seq_length]`` int32 tokens and ``train``.
    seq_length: the tokens of a window.

  Returns:
    ``params(seed)``: ``model.init`` on one window of zeros (jitted once, for
    every seed), keyed by ``jax.random.key(seed, impl="rbg")``.
  """
  init = jax.jit(
    lambda key: model.init(key, jnp.zeros((1, seq_length), jnp.int32), train=False)["params"]
  )
  return lambda seed: jax.tree.map(np.asarray, init(jax.random.key(seed, impl="rbg")))


def run_controller(spec: RunSpec) -> simigrad_jax.controllers.BatchSizeController:
  """The run's controller: ``make_controller`` of its options, in
  :class:`simigrad_jax.controllers.OneStepLateController` where they say ``one_step_late``."""
  options = dict(spec.options)
  one_step_late = options.pop(ONE_STEP_LATE, 0)
  controller = simigrad_jax.make_controller(spec.controller, **options)
  return OneStepLateController(controller) if one_step_late else controller


@contextlib.contextmanager
def comparison_folder(workdir: str | None, prefix: str) -> Iterator[pathlib.Path]:
  """The folder a comparison's runs work in, and JAX's compilation-cache settings put back after.

  The runs' trainers point JAX's process-wide persistent cache into the
  folder; on leaving, its settings are restored before the folder goes.

  Args:
    workdir: ``--workdir``: a folder that keeps every run's workdir (made if
      absent, kept afterwards); None for a temporary folder, removed on leaving.
    prefix: the temporary folder's name prefix.

  Yields:
    The folder, as an absolute path.
  """
  keep = workdir is not None
  root = pathlib.Path(workdir).absolute() if keep else pathlib.Path(tempfile.mkdtemp(prefix=prefix))
  root.mkdir(parents=True, exist_ok=True)
  with contextlib.ExitStack() as cleanup:
    if not keep:
      cleanup.callback(shutil.rmtree, root, ignore_errors=True)
    cleanup.enter_context(persistent_cache_settings())
    yield root


def train_run(exp: Any, spec: RunSpec) -> dict[str, Any]:
  """Trains one run for ``exp``'s epoch budget with the real Trainer; returns its JSON record.

  Args:
    exp: the task's experiment: ``make_trainer(controller, lr, seed, workdir,
      lr_rule=...)``, ``eval_fn(params, model_state)`` (with ``val_accuracy``,
      ``val_loss``, ``test_accuracy`` and ``test_loss``), ``num_train``,
      ``epochs``, ``root`` (where workdirs go) and ``keep_workdirs``.
    spec: the run.

  Returns:
    The record (:data:`RUN_KEYS` and more; see ``benchmarks/pareto/pareto.py``).
  """
  workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"{spec.controller}-", dir=exp.root))
  start = time.perf_counter()
  controller = run_controller(spec)
  with exp.make_trainer(controller, spec.lr, spec.seed, workdir, lr_rule=spec.lr_rule) as trainer:
    summary = trainer.train(num_epochs=exp.epochs)
    final = exp.eval_fn(trainer.state["params"], trainer.state.get("model_state"))
  wall = time.perf_counter() - start
  records = [r for r in simigrad_jax.read_metrics(workdir / "metrics.jsonl") if "batch_size" in r]
  if not exp.keep_workdirs:
    shutil.rmtree(workdir, ignore_errors=True)
  sizes = np.array([r["batch_size"] for r in records], np.float64)
  return {
    "controller": spec.controller,
    "seed": spec.seed,
    "test_accuracy": float(final["test_accuracy"]),
    "avg_batch_size": float(sizes.sum() / len(sizes)),
    "steps": int(summary["steps"]),
    "wall_seconds": round(float(wall), 3),
    "settings": spec.settings_dict(),
    "label": spec.label(),
    "val_accuracy": float(final["val_accuracy"]),
    "val_loss": round(float(final["val_loss"]), 6),
    "test_loss": round(float(final["test_loss"]), 6),
    "train_loss": _finite_or_none(summary["loss"]),
    "examples": int(sizes.sum()),
    "train_seconds": round(float(summary["wall_seconds"]), 3),
    "compile_seconds": round(float(summary["compile_seconds"]), 3),
    "final_batch_size": int(records[-1]["next_batch_size"]),
    "max_batch_size": int(sizes.max()),
    "nonfinite_steps": int(records[-1]["nonfinite_steps"]),
    "trace": _trace(records, exp.num_train),
    **({"workdir": str(workdir)} if exp.keep_workdirs else {}),
  }


_ROUNDING = {
  "wall_seconds": 3,
  "train_seconds": 3,
  "compile_seconds": 3,
  "val_loss": 6,
  "test_loss": 6,
  "train_loss": 6,
}


def compact(run: dict[str, Any]) -> dict[str, Any]:
  """The run with its timings and losses rounded (a smaller JSON; accuracies stay exact)."""
  return {
    k: round(v, _ROUNDING[k]) if k in _ROUNDING and isinstance(v, float) else v
    for k, v in run.items()
  }


def _finite_or_none(value: Any) -> float | None:
  return round(float(value), 6) if value is not None and math.isfinite(float(value)) else None


def _trace(records: list[dict[str, Any]], num_examples: int, points: int = 24) -> dict[str, list]:
  """The batch size and similarity over training, averaged into at most ``points`` bins of steps.

  The run's last step, cut short to land exactly on the epoch budget, is left out.
  """
  if len(records) > 1:
    records = records[:-1]
  epochs = np.array([r["examples_seen"] for r in records], np.float64) / num_examples
  sizes = np.array([r["batch_size"] for r in records], np.float64)
  sims = np.array([np.nan if r["similarity"] is None else r["similarity"] for r in records])
  bins = np.array_split(np.arange(len(records)), min(points, len(records)))
  out = {"epochs": [], "batch_size": [], "similarity": []}
  for b in bins:
    out["epochs"].append(round(float(epochs[b[-1]]), 4))
    out["batch_size"].append(round(float(sizes[b].mean()), 2))
    finite = sims[b][np.isfinite(sims[b])]
    out["similarity"].append(round(float(finite.mean()), 4) if finite.size else None)
  return out


# ----------------------------------------------------------------------------
# The grid.
# ----------------------------------------------------------------------------


def base_lr_for(batch_size: int, base_lr: float, base_batch_size: int) -> float:
  """The sqrt-scaled learning rate: ``base_lr * sqrt(B / base_batch_size)``."""
  return base_lr * math.sqrt(batch_size / base_batch_size)


def fixed_specs(
  sizes: Sequence[int],
  multipliers: Sequence[float],
  seeds: Sequence[int],
  base_lr: float,
  base_batch_size: int,
) -> list[RunSpec]:
  """Every fixed batch size with every learning-rate multiplier and seed."""
  return [
    RunSpec(
      "fixed", (("initial_batch_size", b),), base_lr_for(b, base_lr, base_batch_size) * m, m, seed
    )
    for b in sizes
    for m in multipliers
    for seed in seeds
  ]


def adaptive_specs(
  args: argparse.Namespace,
  grid: dict[str, Any],
  lr_variants: Sequence[tuple[float, float, str]],
  num_train: int,
) -> list[RunSpec]:
  """The adaptive runs, all starting at ``--initial-batch-size``.

  Each setting runs once per ``(lr, multiplier, lr_rule)`` in ``lr_variants``
  (the learning rate at B_0 and how the trainer scales it as the batch moves)
  and per seed.
  """
  specs = []
  for lr, multiplier, rule in lr_variants:
    specs += _adaptive_specs_at(args, grid, lr, multiplier, rule, num_train)
  return specs


def _adaptive_specs_at(
  args: argparse.Namespace,
  grid: dict[str, Any],
  lr: float,
  multiplier: float,
  rule: str,
  num_train: int,
) -> list[RunSpec]:
  b0 = args.initial_batch_size
  specs = []
  for seed in grid["seeds"]:
    for lower, upper in grid["bounds"]:
      for target in grid["targets"]:
        for extra in grid["simigrad_options"]:
          specs.append(
            RunSpec(
              "simigrad",
              (
                ("initial_batch_size", b0),
                ("similarity_target", float(target)),
                ("batch_size_lower_bound", lower),
                ("batch_size_upper_bound", upper),
                *sorted(extra.items()),
              ),
              lr,
              multiplier,
              seed,
              rule,
            )
          )
      for m in grid["gns"]:
        specs.append(
          RunSpec(
            "gns",
            (
              ("initial_batch_size", b0),
              ("multiple", float(m)),
              ("batch_size_lower_bound", lower),
              ("batch_size_upper_bound", upper),
              ("ema_decay", args.gns_ema_decay),
              ("max_change", 1.1),
            ),
            lr,
            multiplier,
            seed,
            rule,
          )
        )
    top = min(max(u for _, u in grid["bounds"]), num_train)
    for name in grid["schedules"]:
      if name in ("linear", "geometric"):
        specs.append(
          RunSpec(
            name,
            (
              ("initial_batch_size", b0),
              ("final_batch_size", top),
              ("ramp_epochs", float(grid["epochs"])),
            ),
            lr,
            multiplier,
            seed,
            rule,
          )
        )
      elif name == "loss_plateau":
        specs.append(
          RunSpec(
            name,
            (
              ("initial_batch_size", b0),
              ("factor", 2.0),
              ("patience", 1),
              ("threshold", 0.05),
              ("batch_size_upper_bound", top),
            ),
            lr,
            multiplier,
            seed,
            rule,
          )
        )
      else:
        raise ValueError(f"unknown schedule {name!r}; choose from linear, geometric, loss_plateau")
  return specs


# What must agree between an earlier result and this run for its runs to be reused (at least;
# a task adds its own, e.g. the split sizes). Results from before tasks existed are "images".
REUSE_KEYS = (
  "task",
  "dataset",
  "epochs",
  "hidden",
  "lr_schedule",
  "base_lr",
  "base_batch_size",
  "initial_batch_size",
)
_REUSE_DEFAULTS = {"task": "images"}


class RunCache:
  """The runs of earlier ``--out`` JSONs, to reuse instead of training identical runs again.

  A run is reused when its controller, seed and settings (learning rate
  included) equal a spec's; the experiment's data set, epochs, model and
  learning-rate schedule must be the same (every key of ``expected``, at
  least :data:`REUSE_KEYS`). Earlier files
  are searched in the order given. A reused run keeps the ``reused_from`` of
  the file that first trained it.
  """

  def __init__(self, paths: str | Sequence[str], expected: dict[str, Any]):
    self.paths = [paths] if isinstance(paths, str) else list(paths)
    self.runs: list[tuple[str, dict[str, Any]]] = []
    self.profile, self.profile_from = None, None
    for path in self.paths:
      with open(path, encoding="utf-8") as f:
        earlier = json.load(f)
      for key in expected:
        have = earlier.get(key, _REUSE_DEFAULTS.get(key))
        if have != expected[key]:
          raise ValueError(f"--reuse {path}: {key} is {have!r}, this run has {expected[key]!r}")
      self.runs += [(path, run) for run in earlier["runs"]]
      if self.profile is None and earlier.get("profile"):
        self.profile, self.profile_from = earlier["profile"], path
    self.reused = 0
    self._taken: set[str] = set()

  @staticmethod
  def _key(controller: str, seed: int, settings: dict[str, Any]) -> str:
    return json.dumps([controller, seed, {"lr_rule": "sqrt", **settings}], sort_keys=True)

  def _reused(self, path: str, run: dict[str, Any]) -> dict[str, Any]:
    settings = {"lr_rule": "sqrt", **run["settings"]}
    self._taken.add(self._key(run["controller"], run["seed"], settings))
    return {
      **run,
      "settings": settings,
      "reused": True,
      "reused_from": run.get("reused_from") or path,
    }

  def lookup(self, spec: RunSpec) -> dict[str, Any] | None:
    """The earlier run that ``spec`` would train again, or None."""
    want = spec.settings_dict()
    for path, run in self.runs:
      have = {"lr_rule": "sqrt", **run["settings"]}
      if (
        run["controller"] == spec.controller
        and run["seed"] == spec.seed
        and math.isclose(have["learning_rate"], want["learning_rate"], rel_tol=1e-9)
        and have.keys() == want.keys()  # a run with an option more is another setting
        and all(have[k] == v for k, v in want.items() if k != "learning_rate")
      ):
        self.reused += 1
        return self._reused(path, run)
    return None

  def rest(self) -> list[dict[str, Any]]:
    """The earlier runs no :meth:`lookup` took (each setting and seed once), marked reused."""
    out = []
    for path, run in self.runs:
      if self._key(run["controller"], run["seed"], run["settings"]) not in self._taken:
        out.append(self._reused(path, run))
    self.reused += len(out)
    return out
