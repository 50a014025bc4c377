"""Console output of a training run: the start line, one line per epoch, the summary table.

Host side, process 0 only. Per-epoch lines are printed with ``tqdm.write`` so
they appear above the progress bar; their batch-size and similarity averages
come from the step records of that epoch in ``metrics.jsonl``, which is read
incrementally (each line once).
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import tqdm

import simigrad_jax
from simigrad_jax import read_metrics
from simigrad_jax.checkpoint import missing_steps
from simigrad_jax.trainer.progress import ProgressBar


def _mean(values: list[float]) -> float:
  values = [v for v in values if v is not None and math.isfinite(v)]
  return float(np.mean(values)) if values else math.nan


class EpochPrinter:
  """An ``eval_fn`` for the Trainer that evaluates and prints one line per finished epoch.

  Args:
    evaluate: ``evaluate(params, model_state) -> {"accuracy", "loss"}``.
    workdir: the run's workdir (its ``metrics.jsonl`` is read).
    num_epochs: the run's length, for the ``epoch e/N`` column.
    eval_name: what the evaluation set is called ("test", "validation", ...).
    enabled: print (process 0); otherwise only evaluate.
    eval_examples: the evaluation set's size: with it (and ``enabled``), a
      progress bar over its examples while it is evaluated (``evaluate``
      takes ``progress=``, :func:`train.tasks.make_evaluate`), cleared when
      done, and after the last epoch's a line on stderr that says the final
      checkpoint is being saved.

  Set ``trainer`` once the Trainer exists: the line shows its step and
  examples seen.
  """

  def __init__(
    self,
    evaluate: Callable[[Any, Any], dict[str, float]] | None,
    workdir: pathlib.Path,
    num_epochs: float,
    *,
    eval_name: str = "eval",
    enabled: bool = True,
    eval_examples: int | None = None,
  ):
    self.evaluate, self.enabled, self.eval_name = evaluate, enabled, eval_name
    self.eval_examples = eval_examples
    self.num_epochs = num_epochs
    self.trainer: Any = None
    self._path = pathlib.Path(workdir) / "metrics.jsonl"
    self._offset = 0
    self._steps: dict[int, list[dict[str, Any]]] = {}  # epoch -> its step records

  def _read_new_records(self) -> None:
    if not self._path.exists():
      return
    with open(self._path, "rb") as f:
      f.seek(self._offset)
      data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    self._offset += len(complete)
    for line in complete.splitlines():
      try:
        record = json.loads(line)
      except ValueError:
        continue
      if isinstance(record, dict) and "batch_size" in record and "epoch" in record:
        self._steps.setdefault(record["epoch"], []).append(record)

  def __call__(self, params: Any, model_state: Any) -> dict[str, float]:
    if not self.enabled or self.eval_examples is None:
      results = self.evaluate(params, model_state)
    else:
      with ProgressBar(self.eval_examples, desc=f"evaluate ({self.eval_name})", leave=False) as bar:
        results = self.evaluate(params, model_state, progress=bar.update)
    if not self.enabled or self.trainer is None:
      return results
    self._read_new_records()
    epoch = self.trainer.sampler.epoch - 1  # the epoch just finished
    steps = self._steps.pop(epoch, [])
    for old in [e for e in self._steps if e < epoch]:
      del self._steps[old]
    examples = sum(r["batch_size"] for r in steps)
    average = examples / len(steps) if steps else math.nan
    similarity = _mean([r["similarity"] for r in steps])
    total = f"{self.num_epochs:g}"
    tqdm.tqdm.write(
      f"epoch {epoch + 1:>{len(total)}}/{total}  "
      f"{self.eval_name} accuracy {results['accuracy']:.4f}  loss {results['loss']:.4f}  |  "
      f"batch size {average:6.1f} avg, {self.trainer.controller.batch_size} next  "
      f"similarity {similarity:+.3f} avg  |  step {self.trainer.step}  "
      f"examples {self.trainer.sampler.examples_seen:,}"
    )
    if epoch + 1 >= self.num_epochs and self.eval_examples is not None:  # then the last save
      tqdm.tqdm.write(f"saving the checkpoint of step {self.trainer.step} ...", file=sys.stderr)
    return results


def print_start(experiment: Any, trainer: Any) -> None:
  """One paragraph: what trains on which devices, with which controller, and where the files go."""
  config, data = experiment.config, experiment.datasets
  devices = experiment.devices
  controller = trainer.controller
  lower, upper = simigrad_jax.controllers.batch_size_bounds(controller)
  bounds = f"[{lower or 1}, {upper or len(data.train)}]"
  target = simigrad_jax.controllers.similarity_target(controller)
  lines = [
    f"simigrad-jax: {config.model} on {data.description}: {len(data.train):,} training "
    f"examples" + (f", {len(data.eval):,} for evaluation" if data.eval is not None else ""),
    f"  devices: {describe_devices(devices, experiment.halves, config.mesh_shape)} "
    f"({jax.process_count()} process(es))",
    f"  controller: {config.controller}, initial batch {config.initial_batch_size}, "
    f"bounds {bounds}"
    + (f", similarity target {target}" if target is not None else "")
    + f"; lr {config.optimizer} {config.learning_rate} x {config.lr_rule}(B / B0)",
    f"  workdir: {trainer.workdir}",
    f"  compilation cache: {compilation_cache_dir() or 'off'}",
  ]
  if trainer.step:
    lines.append(
      f"  resuming from the checkpoint at step {trainer.step} "
      f"({trainer.sampler.examples_seen:,} examples seen)"
    )
  print("\n".join(lines), flush=True)


def compilation_cache_dir() -> str | None:
  """The directory of JAX's persistent compilation cache in this process, or None when it is off."""
  if not jax.config.jax_enable_compilation_cache:
    return None
  return jax.config.jax_compilation_cache_dir


def describe_devices(devices: list[Any], halves: str, mesh_shape: str = "") -> str:
  """E.g. ``8 x cpu, device halves``, or ``8 x cpu, mesh 4x2 (batch x model), device halves``."""
  mesh = f", mesh {mesh_shape} (batch x model)" if mesh_shape else ""
  return f"{len(devices)} x {devices[0].platform}{mesh}, {halves} halves"


def summarize(
  workdir: pathlib.Path,
  run: dict[str, Any],
  devices: list[Any],
  seconds: float,
  halves: str,
  *,
  setup_seconds: float | None = None,
) -> dict[str, Any]:
  """The whole run's numbers (resumed parts included) from ``metrics.jsonl`` and this invocation's ``run`` summary.

  Args:
    workdir: the run's workdir.
    run: this invocation's ``Trainer.train`` summary.
    devices: the devices it trained on.
    seconds: this invocation's runtime.
    halves: the split of each step into halves.
    setup_seconds: of ``seconds``, those before its first step (the data, the
      model, the Trainer); with it the summary splits the runtime into its
      parts, each second in one of them (:func:`runtime_parts`).
  """
  path = pathlib.Path(workdir) / "metrics.jsonl"
  records = read_metrics(path) if path.exists() else []
  steps = [r for r in records if "batch_size" in r]
  evals = [r for r in records if "eval_accuracy" in r]
  last = steps[-1] if steps else {}
  nonfinite = [r for r in steps if r.get("grads_finite") is False or r.get("nonfinite_cause")]
  examples = last.get("examples_seen", run["examples_seen"])
  count = last.get("step", run["steps"])
  return {
    # Steps whose records damage took and nothing restored: never counted as present.
    "missing_steps": missing_steps(steps, count),
    "eval_accuracy": evals[-1]["eval_accuracy"] if evals else run.get("eval_accuracy"),
    "eval_loss": evals[-1].get("eval_loss") if evals else run.get("eval_loss"),
    "steps": count,
    "examples_seen": examples,
    "average_batch_size": examples / count if count else math.nan,
    "final_batch_size": run["final_batch_size"],
    "last_loss": last.get("loss"),
    "steps_this_run": run["run_steps"],
    "compiles": run["compiles"],
    "compile_seconds": run["compile_seconds"],
    "compile_wait_seconds": run["compile_wait_seconds"],
    "compile_cache_hits": run["compile_cache_hits"],
    "compile_cache_hit_seconds": run["compile_cache_hit_seconds"],
    "compile_fallback_steps": run["compile_fallback_steps"],
    "first_run_steps": run.get("first_run_steps"),
    "first_run_seconds": run.get("first_run_seconds"),
    "padding_fraction": run.get("padding_fraction"),
    **_own_shape_padding(steps[len(steps) - run["run_steps"] :] if run["run_steps"] else []),
    "nonfinite_steps": len(nonfinite),
    "first_nonfinite_step": (
      {"step": nonfinite[0]["step"], "batch_size": nonfinite[0]["batch_size"]}
      if nonfinite
      else None
    ),
    "compiled_micro_batch_sizes": run["compiled_micro_batch_sizes"],
    "devices": describe_devices(devices, halves),
    "seconds": seconds,
    **runtime_parts(run, seconds, setup_seconds),
    "metrics": str(path),
    "tensorboard": str(pathlib.Path(workdir) / "tensorboard"),
    "checkpoints": str(pathlib.Path(workdir) / "checkpoints"),
  }


def runtime_parts(
  run: dict[str, Any], seconds: float, setup_seconds: float | None
) -> dict[str, float | None]:
  """This invocation's runtime in parts that add up to it, each second counted in one.

  Args:
    run: this invocation's ``Trainer.train`` summary: its steps' seconds
      (``wall_seconds``), of them the waits for compiles
      (``step_compile_wait_seconds``), and the first runs' seconds and waits.
    seconds: the runtime.
    setup_seconds: the seconds before the first step (None: unknown, no parts).

  Returns:
    ``setup_seconds`` (before the first step), ``step_seconds`` (the steps,
    from the first one's start to the last one's end: the evaluations and
    checkpoints between them included), of those ``step_wait_seconds``
    waiting for compiles and ``step_compute_seconds`` the rest, of which
    ``first_run_extra_seconds`` the first runs of programs took beyond their
    wait; and ``after_steps_seconds`` (the final evaluation and save, and the
    report), all None without ``setup_seconds``.

  Example:
    >>> run = {"wall_seconds": 8.0, "step_compile_wait_seconds": 5.0,
    ...        "first_run_seconds": 6.0, "first_run_wait_seconds": 5.0}
    >>> parts = runtime_parts(run, 12.0, setup_seconds=3.0)
    >>> parts["setup_seconds"] + parts["step_seconds"] + parts["after_steps_seconds"]
    12.0
    >>> parts["step_wait_seconds"], parts["step_compute_seconds"], parts["first_run_extra_seconds"]
    (5.0, 3.0, 1.0)
  """
  names = (
    "setup_seconds",
    "step_seconds",
    "step_wait_seconds",
    "step_compute_seconds",
    "first_run_extra_seconds",
    "after_steps_seconds",
  )
  if setup_seconds is None:
    return dict.fromkeys(names)
  steps = run.get("wall_seconds") or 0.0
  waited = run.get("step_compile_wait_seconds") or 0.0
  first_runs = (run.get("first_run_seconds") or 0.0) - (run.get("first_run_wait_seconds") or 0.0)
  return dict(
    zip(
      names,
      (setup_seconds, steps, waited, steps - waited, first_runs, seconds - setup_seconds - steps),
    )
  )


def _own_shape_padding(records: list[dict[str, Any]]) -> dict[str, Any]:
  """The padding of the steps that ran their own shape, apart from the fallback steps'.

  A step whose programs the compile schedule has not admitted yet runs the
  same batch on admitted ones (more micro-steps, or a larger shape padded
  with zero-weight rows); which steps do follows from the step count, the same
  in every run of a config, busy machine or not. The steps on their own plan
  pad only to the grid's next size.
  """
  own = [r for r in records if not r.get("compile_fallback")]
  rows = sum(r["batch_size"] + r.get("padded_examples", 0) for r in own)
  return {
    "own_shape_steps": len(own),
    "own_shape_padding_fraction": (
      sum(r.get("padded_examples", 0) for r in own) / rows if rows else math.nan
    ),
  }


def _padding_row(summary: dict[str, Any]) -> str:
  """The padding line: the share of the rows computed, and where it came from."""
  text = f"{summary['padding_fraction']:.1%} of the rows computed (this run's steps)"
  fallback = summary["compile_fallback_steps"]
  own = summary.get("own_shape_padding_fraction")
  if not fallback or not isinstance(own, float) or not math.isfinite(own):
    return text
  return (
    f"{text}: {own:.1%} on the {summary['own_shape_steps']} steps that ran their own shape, "
    f"the rest on the {fallback} that ran other programs while theirs compiled "
    "(the compile schedule's fallback steps, the same in every run of this config)"
  )


def token_counts(summary: dict[str, Any], run: dict[str, Any], datasets: Any) -> dict[str, Any]:
  """A language model's numbers in tokens: tokens seen, tokens per second, the unigram entropy.

  Args:
    summary: the run's summary (:func:`summarize`).
    run: this invocation's ``Trainer.train`` summary (its examples and seconds).
    datasets: the run's :class:`train.input_pipeline.Datasets`; nothing is
      returned without ``tokens_per_example``.

  Returns:
    ``tokens_seen`` (the whole run), ``tokens_per_second`` (this
    invocation's training steps, compiles included), ``unigram_entropy`` and
    ``eval_loss_unit`` (``"nats/token"``), or ``{}``.
  """
  per_example = getattr(datasets, "tokens_per_example", None)
  if not per_example:
    return {}
  seconds = run.get("wall_seconds") or 0.0
  return {
    "tokens_seen": summary["examples_seen"] * per_example,
    "tokens_per_second": run["run_examples"] * per_example / seconds if seconds else math.nan,
    "unigram_entropy": datasets.unigram_entropy,
    "eval_loss_unit": "nats/token",
  }


def _first_runs_seconds(summary: dict[str, Any]) -> str:
  """What the first runs took beyond their wait for the compile (the wait is the runtime row's)."""
  extra = summary.get("first_run_extra_seconds")
  if extra is None:
    return f" ({summary['first_run_seconds']:.1f} s; this run's steps)"
  return f" ({extra:.1f} s beyond their wait for its compile; this run's steps)"


def _runtime_row(summary: dict[str, Any]) -> str:
  """The runtime, and the parts that add up to it (:func:`runtime_parts`), when known."""
  if summary.get("setup_seconds") is None:
    return f"{summary['seconds']:.1f} s"
  return (
    f"{summary['seconds']:.1f} s: {summary['setup_seconds']:.1f} s before the first step "
    f"(data, model, first trace), {summary['step_seconds']:.1f} s of steps "
    f"({summary['step_wait_seconds']:.1f} s waiting for compiles, "
    f"{summary['step_compute_seconds']:.1f} s training, evaluating and saving), "
    f"{summary['after_steps_seconds']:.1f} s after the last step (the final evaluation and save)"
  )


def _programs_row(summary: dict[str, Any]) -> str:
  """The step programs compiled and those loaded from the compilation cache, apart, e.g. ``0
  compiled, 5 loaded from the compilation cache (micro-batch sizes [1, 2, 4]; 4.8 s in the
  background, all of it tracing, lowering and loading; 33 steps on a fallback shape)``."""
  loaded, seconds = summary["compile_cache_hits"], summary["compile_seconds"]
  compiled = summary["compiles"] - loaded
  if loaded == 0:
    work = f"{seconds:.1f} s compiling, in the background"
  elif compiled == 0:
    work = f"{seconds:.1f} s in the background, all of it tracing, lowering and loading"
  else:
    work = (
      f"{seconds:.1f} s in the background, {summary['compile_cache_hit_seconds']:.1f} s of it "
      "tracing, lowering and loading"
    )
  return (
    f"{compiled} compiled, {loaded} loaded from the compilation cache (micro-batch sizes "
    f"{sorted(summary['compiled_micro_batch_sizes'])}; {work}; "
    f"{summary['compile_fallback_steps']} steps on a fallback shape)"
  )


def _nonfinite_row(summary: dict[str, Any]) -> str:
  """E.g. ``2 skipped (the first: step 7, batch size 24)``, or ``none``."""
  first = summary.get("first_nonfinite_step")
  if not first:
    return "none"
  return (
    f"{summary['nonfinite_steps']} skipped (the first: step {first['step']}, batch size "
    f"{first['batch_size']})"
  )


def _missing_row(ranges: list[list[int]]) -> str:
  steps = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)
  return f"steps {steps} (lost from metrics.jsonl, not in the TensorBoard events either)"


def print_summary(
  summary: dict[str, Any], how_to_continue: str = "give more --config.num_epochs"
) -> None:
  """The summary table and where the files are; ``how_to_continue``: what a complete run's
  note says continues it (:func:`train.run_settings.how_to_continue`)."""
  accuracy = summary["eval_accuracy"]
  if not summary["steps_this_run"]:
    print(
      f"nothing to train: the run in this workdir is complete ({summary['steps']:,} steps); "
      f"{how_to_continue} to continue it, or a new --workdir",
      flush=True,
    )
  rows = [
    (
      f"final {summary.get('eval_name', 'eval')} accuracy",
      "n/a" if accuracy is None else f"{accuracy:.4f}",
    ),
    *(
      [
        (
          f"final {summary.get('eval_name', 'eval')} loss",
          f"{summary['eval_loss']:.4f} nats/token (unigram entropy "
          f"{summary['unigram_entropy']:.4f})"
          if summary.get("eval_loss") is not None
          else "n/a",
        ),
        ("tokens seen", f"{summary['tokens_seen']:,}"),
        ("tokens per second", f"{summary['tokens_per_second']:,.0f} (this run's steps)"),
      ]
      if "tokens_seen" in summary
      else []
    ),
    ("average batch size", f"{summary['average_batch_size']:.1f}"),
    ("final batch size", summary["final_batch_size"]),
    ("optimizer steps", f"{summary['steps']:,} ({summary['steps_this_run']:,} in this run)"),
    ("examples seen", f"{summary['examples_seen']:,}"),
    *(
      [("missing records", _missing_row(summary["missing_steps"]))]
      if summary.get("missing_steps")
      else []
    ),
    ("non-finite steps", _nonfinite_row(summary)),
    ("step programs", _programs_row(summary)),
    *(
      [
        (
          "first runs",
          f"{summary['first_run_steps']} steps ran a shape's program for the first time"
          + _first_runs_seconds(summary),
        )
      ]
      if summary.get("first_run_steps") is not None
      else []
    ),
    *(
      [("padding", _padding_row(summary))]
      if isinstance(summary.get("padding_fraction"), float)
      and math.isfinite(summary["padding_fraction"])
      else []
    ),
    ("devices", summary["devices"]),
    ("runtime", _runtime_row(summary)),
    ("metrics", summary["metrics"]),
    ("tensorboard", f"tensorboard --logdir {summary['tensorboard']}"),
  ]
  if summary.get("plot"):
    rows.append(("plot", summary["plot"]))
  width = max(len(name) for name, _ in rows)
  print("\n".join(f"{name:<{width}}  {value}" for name, value in rows), flush=True)
