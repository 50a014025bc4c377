"""Benchmark: the step-time model of ``python -m simigrad_jax.cluster_time``, fitted and checked.

The Trainer's step time, measured on 1, 2, 4 and 8 simulated CPU devices at
several global batch sizes, for the two models of the batch-size comparisons
in docs/results.md: MNIST's MLP (784-64-10, SGD with momentum) and the causal
LM (width 64, 2 layers, 4 heads, MLP 256, 64 characters a window, AdamW).
Each device count runs in its own worker process
(:func:`simigrad_jax.simulated_cpu_devices_env`), which builds one Trainer
per model and batch size, held there (one shape, no padding), and compiles
and warms them up first. Then ``--rounds`` rounds time ``--steps`` steps of
every (devices, model, batch) point, one worker at a time, the order
rotating each round; a point's step time is the median over its rounds of
the median ``step_seconds`` of its window (the first step of each window,
which waits for ``train()`` to start, left out), its host path the same of
``host_seconds``.

The CPU model (:class:`simigrad_jax.cluster_time.model.CpuStepModel`) is fitted
per model to the calibration points (batch sizes that bracket the
validation ones) by non-negative least squares on relative errors, and
each validation point's ``predicted_s`` comes from that fit, so that the
error in the table is out of sample. The fitted per-device curve (the
1-device term), the host path and the gradient's bytes and FLOPs per
example are what the cluster prediction takes from this sweep (``models``
in the JSON).

NOTE: this machine's 2 cores are shared with other users: the rounds
alternate so that a slow minute hits every point alike, and the medians
are reported.

Usage::

  python benchmarks/cluster/cluster_time.py                # writes benchmarks/results/cluster_time.json
  python benchmarks/cluster/cluster_time.py --quick --out ''

``--worker N`` is the worker's own entry point (it reads one JSON command a
line on stdin and answers one JSON line on stdout).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks import common  # noqa: E402  (imports no JAX)

DEVICE_COUNTS = (1, 2, 4, 8)
FULL = {
  "batch_sizes": {"mnist": [32, 128, 512], "lm": [16, 64, 128]},  # validated
  "calibration_batch_sizes": {"mnist": [16, 64, 256, 1024], "lm": [8, 32, 256]},  # fitted
  "steps": 24,
  "rounds": 5,
  "warmup_steps": 3,
}
QUICK = {
  "batch_sizes": {"mnist": [16], "lm": [16]},
  "calibration_batch_sizes": {"mnist": [8, 32], "lm": [8, 32]},
  "steps": 3,
  "rounds": 2,
  "warmup_steps": 1,
}
DOCS_JSON = os.path.join(common.PLOTS_DIR, "cluster_time.json")  # what the tool reads by default
GOAL = 0.15  # every point's predicted step time within 15% of the measured
SEQ_LENGTH = 64
VOCAB = 65


# ----------------------------------------------------------------------------
# The worker: one device count, one Trainer per (model, batch size).
# ----------------------------------------------------------------------------


def _model(name: str, quick: bool) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
  """``(loss_fn, params, optimizer, data, info)`` of one of the comparisons' models."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import simigrad_jax  # pylint: disable=import-outside-toplevel
  from train import models  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)
  tail = (simigrad_jax.scale_by_lr_factor(),)
  if name == "mnist":
    model = models.MLP(num_classes=10, hidden=(16,) if quick else (64,))
    data = {
      "x": rng.standard_normal((4096, 784), dtype=np.float32),
      "y": rng.integers(0, 10, 4096).astype(np.int32),
    }
    params = model.init(jax.random.key(0), data["x"][:1])["params"]
    optimizer = optax.sgd(0.05, momentum=0.9)

    def loss_fn(params, model_state, batch, weights, rng):
      del weights, rng
      logits = model.apply({"params": params}, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), model_state

    description = f"MLP 784-{16 if quick else 64}-10, SGD with momentum 0.9"
    examples_tokens = 1
  else:
    hidden = 16 if quick else 64
    model = models.CausalLM(
      vocab_size=VOCAB, max_length=SEQ_LENGTH, hidden=hidden, layers=2, heads=4, mlp=4 * hidden
    )
    data = {"tokens": rng.integers(0, VOCAB, (4096, SEQ_LENGTH + 1)).astype(np.int32)}
    params = model.init(jax.random.key(0), jnp.zeros((1, SEQ_LENGTH), jnp.int32), train=False)[
      "params"
    ]
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, b2=0.99))

    def loss_fn(params, model_state, batch, weights, rng):
      del weights, rng
      tokens = batch["tokens"]
      logits = model.apply({"params": params}, tokens[:, :-1], train=False)
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
      return jnp.mean(losses, -1), model_state

    description = f"causal LM (width {hidden}, 2 layers, 4 heads, MLP {4 * hidden}), AdamW"
    examples_tokens = SEQ_LENGTH
  params = jax.tree.map(np.asarray, params)
  optimizer = optax.chain(simigrad_jax.transform("batch"), optimizer, *tail)
  info = {
    "description": description,
    "parameters": int(sum(np.size(p) for p in jax.tree.leaves(params))),
    "gradient_bytes": int(sum(np.asarray(p).nbytes for p in jax.tree.leaves(params))),
    "tokens_per_example": examples_tokens,
    "flops_per_example": _flops_per_example(loss_fn, params, data),
  }
  return loss_fn, params, optimizer, data, info


def _flops_per_example(loss_fn: Any, params: Any, data: dict[str, Any]) -> float:
  """XLA's FLOPs of the loss's gradient on 2 examples less those on 1 (the fixed part out)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def flops(rows: int) -> float:
    batch = {key: value[:rows] for key, value in data.items()}
    grad = jax.grad(lambda p: jnp.mean(loss_fn(p, None, batch, None, None)[0]))
    cost = jax.jit(grad).lower(params).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0))

  return (flops(64) - flops(32)) / 32


class _Times:
  """A Trainer hook: each step's ``step_seconds`` and ``host_seconds``."""

  def __init__(self) -> None:
    self.steps: list[tuple[float, float]] = []

  def on_step(self, record: Any) -> None:
    self.steps.append((record.step_seconds, record.host_seconds))


def worker(devices: int, batch_sizes: dict[str, list[int]], warmup: int, quick: bool) -> None:
  """Builds and warms up the Trainers, says ready, then times windows on command."""
  import jax  # pylint: disable=import-outside-toplevel

  import simigrad_jax  # pylint: disable=import-outside-toplevel

  assert jax.device_count() == devices, (jax.device_count(), devices)
  root = tempfile.mkdtemp(prefix=f"simigrad-cluster-time-{devices}-")
  trainers: dict[tuple[str, int], tuple[Any, _Times]] = {}
  infos = {}
  try:
    for name, sizes in batch_sizes.items():
      loss_fn, params, optimizer, data, infos[name] = _model(name, quick)
      for size in sizes:
        times = _Times()
        controller = simigrad_jax.Controller(
          size, 0.1, batch_size_lower_bound=size, batch_size_upper_bound=size, enable_adjust=False
        )
        trainer = simigrad_jax.Trainer(
          loss_fn=loss_fn,
          params=params,
          optimizer=optimizer,
          source=simigrad_jax.ArraySource(data),
          controller=controller,
          workdir=os.path.join(root, f"{name}-{size}"),
          hooks=[times],
          config=simigrad_jax.TrainerConfig(
            max_micro_batch_size=size // devices,
            axis_name="batch",
            seed=0,
            progress=False,
            tensorboard=False,
            checkpoints=simigrad_jax.CheckpointConfig(max_to_keep=1),
          ),
        )
        trainer.train(num_steps=warmup)
        trainers[name, size] = (trainer, times)
    print(json.dumps({"ready": devices, "models": infos}), flush=True)
    for line in sys.stdin:
      command = json.loads(line)
      trainer, times = trainers[command["model"], command["batch_size"]]
      times.steps.clear()
      trainer.train(num_steps=trainer.step + command["steps"])
      window = times.steps[1:]  # the first waited for train() to start
      print(
        json.dumps(
          {
            "step_s": statistics.median(s for s, _ in window),
            "host_s": statistics.median(h for _, h in window),
          }
        ),
        flush=True,
      )
  finally:
    for trainer, _ in trainers.values():
      trainer.close()
    shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------
# The parent: the workers, the rounds, the fit.
# ----------------------------------------------------------------------------


def _worker_env(devices: int) -> dict[str, str]:
  """This process's environment with ``devices`` simulated CPU devices (any count set dropped)."""
  import simigrad_jax  # pylint: disable=import-outside-toplevel

  env = common.child_environment(own_device_count=True)
  env["JAX_PLATFORMS"] = "cpu"
  env.update(simigrad_jax.simulated_cpu_devices_env(devices, env))
  return env


class _Worker:
  """A worker process of one device count, spoken to one JSON line at a time."""

  def __init__(self, devices: int, args: argparse.Namespace) -> None:
    command = [sys.executable, os.path.abspath(__file__), "--worker", str(devices)]
    command += ["--batch-sizes-json", json.dumps(_sweep_sizes(args))]
    command += ["--warmup-steps", str(args.warmup_steps)] + (["--quick"] if args.quick else [])
    self.process = subprocess.Popen(
      command,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env=_worker_env(devices),
    )
    self.ready = self._read()

  def _read(self) -> dict[str, Any]:
    assert self.process.stdout is not None
    for line in self.process.stdout:
      if line.startswith("{"):
        return json.loads(line)
    raise RuntimeError(f"worker exited with {self.process.wait()}")

  def time(self, model: str, batch_size: int, steps: int) -> dict[str, float]:
    assert self.process.stdin is not None
    self.process.stdin.write(
      json.dumps({"model": model, "batch_size": batch_size, "steps": steps}) + "\n"
    )
    self.process.stdin.flush()
    return self._read()

  def close(self) -> None:
    if self.process.stdin is not None:
      self.process.stdin.close()
    self.process.wait(timeout=120)


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  """Times every point in alternating rounds; returns the models' info and the points."""
  workers: dict[int, _Worker] = {}
  try:
    for devices in args.devices:  # one at a time: a compiling worker slows a timed one
      print(f"  building the Trainers on {devices} device(s)", flush=True)
      workers[devices] = _Worker(devices, args)
    points = [
      (devices, model, size)
      for devices in args.devices
      for model, sizes in _sweep_sizes(args).items()
      for size in sizes
    ]
    rounds: dict[tuple[int, str, int], list[dict[str, float]]] = {p: [] for p in points}
    for r in range(args.rounds):
      shift = r * len(points) // args.rounds
      for devices, model, size in points[shift:] + points[:shift]:
        rounds[devices, model, size].append(workers[devices].time(model, size, args.steps))
      print(f"  round {r + 1}/{args.rounds} done", flush=True)
    info = workers[args.devices[0]].ready["models"]
  finally:
    for w in workers.values():
      w.close()
  measured = [
    {
      "model": model,
      "devices": devices,
      "batch_size": size,
      "measured_s": statistics.median(t["step_s"] for t in rounds[devices, model, size]),
      "host_s": statistics.median(t["host_s"] for t in rounds[devices, model, size]),
      "rounds_s": [t["step_s"] for t in rounds[devices, model, size]],
      "role": "validation" if size in args.batch_sizes[model] else "calibration",
    }
    for devices, model, size in points
  ]
  return info, measured


def _sweep_sizes(args: argparse.Namespace) -> dict[str, list[int]]:
  """Each model's batch sizes the sweep times: its calibration's and its validation's."""
  calibration = getattr(args, "calibration_batch_sizes", {})
  return {
    model: sorted(set(sizes) | set(calibration.get(model, ())))
    for model, sizes in args.batch_sizes.items()
  }


def run(args: argparse.Namespace) -> dict[str, Any]:
  """Measures, then fits and checks the model; returns the results."""
  start = time.perf_counter()
  load_before = os.getloadavg()[0]
  info, measured = measure(args)
  load = (load_before, os.getloadavg()[0])  # the 1-minute load average before and after
  results = summarize(info, measured, os.cpu_count() or 1, load)
  return {
    **results,
    "device": common.device_record(),
    "steps": args.steps,
    "rounds": args.rounds,
    "wall_seconds": round(time.perf_counter() - start, 1),
  }


def summarize(
  info: dict[str, Any],
  measured: list[dict[str, Any]],
  cores: int,
  load: tuple[float, float] | None = None,
) -> dict[str, Any]:
  """The CPU model fitted per model to its calibration points, and the validation points
  predicted by it.

  Args:
    info: each model's description, parameters, gradient bytes and FLOPs per example.
    measured: the points (``model``, ``devices``, ``batch_size``, ``measured_s``, ``host_s``,
      ``role``: ``"calibration"`` or ``"validation"``).
    cores: the cores the simulated devices shared.
    load: the machine's 1-minute load average before and after the sweep, if known.

  Returns:
    ``models`` (each with its fit, ``device_curve`` and ``host_s``: the calibration
    ``python -m simigrad_jax.cluster_time`` reads), ``calibration`` (the fitted points, each
    with its ``predicted_s`` and ``error`` in sample), ``validation`` (the other points, each
    with its ``predicted_s`` and ``error`` out of sample) and the goal.
  """
  from simigrad_jax.cluster_time import model as cluster_time_model  # pylint: disable=import-outside-toplevel

  models = {}
  checked: dict[str, list[dict[str, Any]]] = {"calibration": [], "validation": []}
  for name in info:
    points = [p for p in measured if p["model"] == name]
    fitted = [p for p in points if p["role"] == "calibration"]
    if not fitted:
      continue
    fit = cluster_time_model.fit_cpu_model(
      [(p["devices"], p["batch_size"], p["measured_s"], p["host_s"]) for p in fitted], cores
    )
    for p in points:
      predicted = fit.seconds(p["batch_size"], p["devices"], p["host_s"])
      checked[p["role"]].append(
        {**p, "predicted_s": predicted, "error": predicted / p["measured_s"] - 1}
      )
    curve = fit.device_curve()
    models[name] = {
      **info[name],
      "cpu_fit": fit.as_dict(),
      "device_curve": {
        "overhead_s": curve.overhead_s,
        "seconds_per_example": curve.seconds_per_example,
        "seconds_per_example_squared": curve.seconds_per_example_squared,
      },
      "host_s": statistics.median(p["host_s"] for p in points),
    }
  worst = max(abs(v["error"]) for v in checked["validation"])
  return {
    "what": "the Trainer's step time on simulated CPU devices, measured against the model",
    "machine": f"{cores} CPU cores{_load_text(load)}; medians of alternating rounds",
    "devices": sorted({p["devices"] for p in measured}),
    "models": models,
    **checked,
    "max_abs_error": worst,
    "goal": {"max_abs_error": GOAL, "pass": worst <= GOAL},
  }


def _load_text(load: tuple[float, float] | None) -> str:
  """The machine's load during the sweep, in words (the sweep itself adds about 2)."""
  if load is None:
    return ""
  return f", load average {min(load):.1f} to {max(load):.1f} (the sweep's own included)"


COMPARISONS = {
  "lm": (
    "pareto_lm_issue23.json",
    "the causal LM's validation loss target (the Pareto comparison's)",
  ),
  "mnist": (
    "pareto_mnist.json",
    "MNIST test accuracy within the comparison's tolerance of the best constant batch's",
  ),
}
ANSWER_DEVICES = ("h100", "measured")
PLOT_LINKS = ("nvlink", "ethernet")


def add_answers(results: dict[str, Any], png: str | None) -> dict[str, Any]:
  """``results`` with ``answers``: each comparison's time to target on 8 to 1,024 devices over
  NVLink- and Ethernet-class links, for an H100-class device and for the measured one."""
  # pylint: disable=import-outside-toplevel
  from simigrad_jax import cluster_time
  from simigrad_jax.cluster_time import model as cluster_time_model
  from simigrad_jax.cluster_time import to_target

  links = {name: cluster_time.LINKS[name] for name in PLOT_LINKS}
  answers: dict[str, Any] = {}
  for name, (file, target) in COMPARISONS.items():
    if name not in results["models"]:
      continue
    settings = cluster_time.load_settings([os.path.join(common.RESULTS_DIR, file)])
    answers[name] = {
      "comparison": f"benchmarks/results/{file}",
      "target": target,
      **{
        device: cluster_time.answer(
          settings, cluster_time_model.step_model(results, name, device), links
        )
        for device in ANSWER_DEVICES
      },
    }
  if png and answers:
    to_target.plot_answers(
      {
        f"{name}, {ANSWER_DEVICES[0]}-class devices": a[ANSWER_DEVICES[0]]
        for name, a in answers.items()
      },
      png,
      PLOT_LINKS,
    )
    results = {**results, "png": common.repository_path(png)}
  return {**results, "answers": answers}


def markdown(results: dict[str, Any]) -> str:
  """docs/results.md's tables: the validation, and each comparison's time to target on
  H100-class devices (``--markdown JSON`` prints them; a test checks the page holds them)."""
  lines = [
    "| model | devices | batch | measured ms | predicted ms | error |",
    "|---|---|---|---|---|---|",
  ]
  for v in results["validation"]:
    lines.append(
      f"| {v['model']} | {v['devices']} | {v['batch_size']} | {v['measured_s'] * 1e3:.2f} | "
      f"{v['predicted_s'] * 1e3:.2f} | {v['error']:+.1%} |"
    )
  for name, a in results.get("answers", {}).items():
    result = a[ANSWER_DEVICES[0]]
    lines += [
      "",
      f"{name}: seconds to the target, fastest setting of each family, "
      f"{ANSWER_DEVICES[0]}-class devices",
      "",
      "| link | family | " + " | ".join(str(n) for n in result["devices"]) + " |",
      "|---|---|" + "---|" * len(result["devices"]),
    ]
    for link, families in result["best"].items():
      for kind, entries in families.items():
        cells = " | ".join("-" if e is None else f"{e['seconds']:.3g}" for e in entries)
        lines.append(f"| {link} | {kind} | {cells} |")
  return "\n".join(lines)


def _format_table(results: dict[str, Any]) -> str:
  from simigrad_jax.cluster_time.to_target import format_answer  # pylint: disable=import-outside-toplevel

  lines = [
    f"Step time, measured (median of {results.get('rounds')} rounds of {results.get('steps')} "
    "steps) "
    f"against predicted (the model fitted to the calibration points, "
    f"{_calibration_text(results)}); {results['machine']}",
    f"  {'model':6s} {'devices':>7s} {'batch':>6s} {'measured ms':>11s} {'predicted ms':>12s} "
    f"{'error':>7s}",
  ]
  for v in results["validation"]:
    lines.append(
      f"  {v['model']:6s} {v['devices']:7d} {v['batch_size']:6d} {v['measured_s'] * 1e3:11.2f} "
      f"{v['predicted_s'] * 1e3:12.2f} {v['error']:+7.1%}"
    )
  for name, m in results["models"].items():
    fit = m["cpu_fit"]
    lines.append(
      f"  {name}: a device alone, rows r: {fit['launch_s'] * 1e3:.3f} + "
      f"{fit['overhead_s'] * 1e3:.3f} ms + {fit['seconds_per_example'] * 1e6:.1f} us x r + "
      f"{fit['seconds_per_example_squared'] * 1e6:.3f} us x r^2 over "
      f"{fit['device_parallelism']:g} of the {fit['cores']} cores; collective "
      f"{fit['collective_s'] * 1e3:.3f} ms x (N-1); host {m['host_s'] * 1e3:.3f} ms; "
      f"{m['parameters']:,} parameters"
    )
  for name, a in results.get("answers", {}).items():
    for device in ANSWER_DEVICES:
      lines.append(f"{name} on {device} devices, time to {a['target']}:")
      lines.append(format_answer(a[device]))
  goal = results["goal"]
  lines.append(
    f"  goal: every point within 15%: worst {results['max_abs_error']:.1%} "
    f"{'PASS' if goal['pass'] else 'FAIL'}"
  )
  return "\n".join(lines)


def _calibration_text(results: dict[str, Any]) -> str:
  """The calibration's batch sizes and its worst in-sample error, in words."""
  fitted = results.get("calibration", [])
  if not fitted:
    return "none recorded"
  sizes = {
    model: sorted({p["batch_size"] for p in fitted if p["model"] == model})
    for model in results["models"]
  }
  worst = max(abs(p["error"]) for p in fitted)
  listed = "; ".join(f"{model} {', '.join(map(str, s))}" for model, s in sizes.items())
  return f"batches {listed}, within {worst:.1%} of each"


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help=f"tiny, for tests: {QUICK}")
  parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICE_COUNTS))
  parser.add_argument("--steps", type=int, default=None, help="steps per timed window")
  parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
  parser.add_argument("--warmup-steps", type=int, default=None, help="untimed steps first")
  parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--batch-sizes-json", default=None, help=argparse.SUPPRESS)
  parser.add_argument(
    "--answers-only",
    action="store_true",
    help="measure nothing: recompute the answers and plot from the --out JSON's calibration",
  )
  parser.add_argument("--png", default=None, help="the plot (default: docs/cluster_time.png)")
  parser.add_argument("--markdown", default=None, metavar="JSON", help="print docs' tables of JSON")
  parser.add_argument(
    "--docs-json",
    default=None,
    help="also write the calibration, validation and answers here (default: docs/"
    "cluster_time.json for the full run's default --out; '' for none)",
  )
  common.add_out_flag(parser, "cluster_time")
  args = parser.parse_args(argv)
  preset = QUICK if args.quick else FULL
  args.batch_sizes = (
    json.loads(args.batch_sizes_json) if args.batch_sizes_json else preset["batch_sizes"]
  )
  args.calibration_batch_sizes = {} if args.batch_sizes_json else preset["calibration_batch_sizes"]
  common.apply_preset(args, preset, ("steps", "rounds", "warmup_steps"))
  for key in ("steps", "rounds", "warmup_steps"):
    if getattr(args, key) < 1:
      raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
  for devices in args.devices:
    bad = [b for sizes in _sweep_sizes(args).values() for b in sizes if b % devices]
    if devices < 1 or bad:
      raise ValueError(f"--devices {devices}: every batch size must be a multiple; got {bad}")
  default_out = args.out is None and not args.quick
  args.out = common.out_path(args.out, "cluster_time", args.quick)
  if args.docs_json is None:
    args.docs_json = DOCS_JSON if default_out else ""
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
  """Runs the benchmark (or, with ``--worker``, a worker); prints and writes the results."""
  args = _parse_args(argv)
  if args.worker is not None:
    worker(args.worker, args.batch_sizes, args.warmup_steps, args.quick)
    return None
  if args.markdown:
    with open(args.markdown) as f:
      print(markdown(json.load(f)))
    return None
  if args.answers_only:
    with open(args.out) as f:
      results = json.load(f)
  else:
    results = run(args)
  results = add_answers(results, common.plot_path(args.png, args.out))
  common.report(results, _format_table(results), args.out)
  if args.docs_json:
    with open(args.docs_json, "w") as f:
      json.dump(docs_subset(results), f, indent=2)
    print(f"wrote {args.docs_json}")
  return results


DOCS_KEYS = (
  "what",
  "machine",
  "models",
  "calibration",
  "validation",
  "max_abs_error",
  "goal",
  "answers",
)


def docs_subset(results: dict[str, Any]) -> dict[str, Any]:
  """What docs/cluster_time.json keeps of the results: the calibration the tool reads
  (``models``), the ``validation`` table and the ``answers``."""
  return {key: results[key] for key in DOCS_KEYS if key in results}


if __name__ == "__main__":
  main()
