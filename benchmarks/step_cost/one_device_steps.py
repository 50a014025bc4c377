"""Benchmark: every way to take the two halves' gradients on ONE device, against the plain step.

Workloads, AdamW and float32 throughout (``--size full``, the sizes the GPU
goals name; ``--size reduced`` for the CPU; ``--size tiny`` to try the
script):

* ``lm``: a decoder-only transformer LM (``train.models.CausalLM``: 4 layers,
  width 512, 8 heads, MLP 2048, 256 tokens of vocabulary, 13M parameters),
  64 sequences of 256 tokens, next-token cross-entropy;
* ``cnn4``: a 4-stage CNN (two 3x3 convolutions per stage, 64, 128, 256 and
  512 channels, 2x2 average pooling between stages, 4.7M parameters), 512
  images of 32x32x3;
* ``resnet18``: the CIFAR ResNet-18 of ``train/models.py`` (BatchNorm in
  training mode, each half with its own statistics), 128 images of 32x32x3;
* ``mlp``: 784-1024-1024-10 and ``cnn``: three 3x3 convolutions of 16, 32 and
  32 channels on 28x28x1, at a batch of 256 (``halves_steps.py``'s models).

Each workload's steps, all from the same parameters and rows:

* ``plain``: ``jax.value_and_grad`` and the update (the baseline);
* ``halves_sequential``, ``halves_stacked``, ``halves_signed``:
  ``simigrad_jax.value_and_half_grads(..., passes=...)`` and
  ``transform()`` before AdamW;
* ``trainer_sequential``, ``trainer_stacked``, ``trainer_signed``: the
  program the Trainer runs at its steady state on one device (its fused step,
  ``make_fused_step(..., halves="local", passes=...)``: per-example losses
  weighted, the learning-rate factor and the non-finite guard in the step);
  its host path between steps is not timed;
* ``trainer_plain``: the Trainer's program of a step that does not measure
  (``make_plain_step``: one pass over all the rows, the guard and the
  learning-rate factor as above), the steps between two measuring ones with
  ``measure_every``;
* ``trainer_every_4``: ``measure_every=4`` as the device runs it, a cycle of
  three ``trainer_plain`` calls and one ``trainer_sequential`` call, timed
  against four plain steps (its time ratio is the cycle's; its temporary
  memory and similarity are the measuring program's).

Every step runs as a training loop runs it: its parameters, optimizer state
and model state (the first three arguments) donated, and its new ones the
next call's, as the Trainer runs its programs and as a plain ``jax.jit`` loop
with ``donate_argnums`` does. Each step starts from its own copy of the
workload's state; a cycle's programs hand one state from call to call.

Per step: ``paired_time_ratio`` (the median over rounds of its time over
the plain step's, timed back to back in alternating order),
``step_seconds`` and ``plain_step_seconds`` (medians), ``temp_bytes`` and
``temp_ratio`` (``compiled.memory_analysis().temp_size_in_bytes``, against
the plain step's), ``extra_temp_gradients`` (its temporaries beyond the
plain step's, in gradients: the goal is at most 1), ``compile_seconds``
and ``similarity`` (the halves' cosine measured in its first step; the
``halves_*`` steps compare the even rows with the odd ones, the
``trainer_*`` steps the first half of the rows with the second, so each
family agrees within itself). The JSON is rewritten as each step finishes,
so a run cut short keeps every finished part; the workloads run in the
order given (``--workloads``), the most valuable first.

Usage::

  python benchmarks/step_cost/one_device_steps.py --size reduced   # the CPU: one_device_steps_cpu.json
  python benchmarks/step_cost/one_device_steps.py --size tiny --out /tmp/tiny.json
  # One GPU (benchmarks/step_cost/run_gpu.sh runs this, then the other GPU parts):
  JAX_PLATFORMS=cuda python benchmarks/step_cost/one_device_steps.py --size full \\
    --out benchmarks/results/one_device_steps_gpu.json
  python benchmarks/step_cost/one_device_steps.py --markdown benchmarks/results/one_device_steps_cpu.json
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
  from benchmarks import common  # noqa: E402  (imports no JAX)

  common.configure_host_devices(1)
  common.prepare_script()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import simigrad_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.step_cost import timing  # noqa: E402
from simigrad_jax.ingraph import half_batch  # noqa: E402
from simigrad_jax.ingraph import train_step  # noqa: E402
from train import models  # noqa: E402

WORKLOADS = ("lm", "cnn4", "resnet18", "mlp", "cnn")
PASSES = tuple(half_batch.PASSES)
# measure_every's k in the cycle step: k - 1 of the Trainer's plain programs, then its measuring one.
MEASURE_EVERY = 4
# The steps that take the halves' gradients, one per passes policy (the docs' passes table).
PASSES_STEPS = (
  *(f"halves_{name}" for name in PASSES),
  *(f"trainer_{name}" for name in PASSES),
)
# The Trainer's steps of measure_every (the docs' measure_every table).
EVERY_STEPS = ("trainer_plain", f"trainer_every_{MEASURE_EVERY}")
STEPS = ("plain", *PASSES_STEPS, *EVERY_STEPS)
# Per size: each workload's settings, and the timed rounds per step.
SIZES: dict[str, dict[str, Any]] = {
  "full": {
    "rounds": 15,
    "lm": {"batch": 64, "length": 256, "vocab": 256, "hidden": 512, "layers": 4, "heads": 8},
    "cnn4": {"batch": 512, "image": 32, "channels": (64, 128, 256, 512)},
    "resnet18": {"batch": 128, "image": 32, "width": 64, "stages": (2, 2, 2, 2)},
    "mlp": {"batch": 256, "widths": (1024, 1024)},
    "cnn": {"batch": 256, "image": 28, "channels": (16, 32, 32)},
  },
  "reduced": {
    "rounds": 7,
    "lm": {"batch": 16, "length": 64, "vocab": 256, "hidden": 128, "layers": 2, "heads": 4},
    "cnn4": {"batch": 64, "image": 32, "channels": (16, 32, 64, 128)},
    "resnet18": {"batch": 32, "image": 32, "width": 16, "stages": (2, 2, 2, 2)},
    "mlp": {"batch": 256, "widths": (1024, 1024)},
    "cnn": {"batch": 256, "image": 28, "channels": (16, 32, 32)},
  },
  "tiny": {
    "rounds": 2,
    "lm": {"batch": 4, "length": 8, "vocab": 16, "hidden": 16, "layers": 1, "heads": 2},
    "cnn4": {"batch": 4, "image": 8, "channels": (2, 2, 2, 2)},
    "resnet18": {"batch": 4, "image": 8, "width": 2, "stages": (1,)},
    "mlp": {"batch": 4, "widths": (8,)},
    "cnn": {"batch": 4, "image": 8, "channels": (2, 2)},
  },
}


class Workload(NamedTuple):
  """A model with its data: what every step of one workload starts from."""

  params: Any
  model_state: Any  # {} for a model without state (BatchNorm's statistics otherwise).
  batch: dict[str, jax.Array]
  # per_example(params, model_state, batch, weights, rng) -> (losses [rows], new model_state):
  # the Trainer's loss contract; the mean-loss steps average it over the rows.
  per_example: Callable[..., tuple[jax.Array, Any]]


class FourStageCNN(nn.Module):
  """Four stages of two 3x3 convolutions with ReLU, 2x2 average pooling between, then dense."""

  channels: tuple[int, ...]

  @nn.compact
  def __call__(self, x):
    for stage, width in enumerate(self.channels):
      if stage:
        x = nn.avg_pool(x, (2, 2), (2, 2))
      x = nn.relu(nn.Conv(width, (3, 3))(x))
      x = nn.relu(nn.Conv(width, (3, 3))(x))
    return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class SmallNet(nn.Module):
  """``halves_steps.py``'s MLP (``widths``) or small CNN (``channels``)."""

  widths: tuple[int, ...] = ()
  channels: tuple[int, ...] = ()

  @nn.compact
  def __call__(self, x):
    if self.widths:
      x = x.reshape(x.shape[0], -1)
      for width in self.widths:
        x = nn.relu(nn.Dense(width)(x))
    else:
      for width in self.channels:
        x = nn.relu(nn.Conv(width, (3, 3))(x))
      x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(10)(x)


def make_workload(name: str, sizes: dict[str, Any], seed: int = 0) -> Workload:
  """The workload ``name`` at ``sizes`` (one entry of :data:`SIZES`), on the default device."""
  rng = np.random.default_rng(seed)
  batch_size = sizes["batch"]
  if name == "lm":
    model: nn.Module = models.CausalLM(
      vocab_size=sizes["vocab"],
      max_length=sizes["length"],
      hidden=sizes["hidden"],
      layers=sizes["layers"],
      heads=sizes["heads"],
      mlp=4 * sizes["hidden"],
    )
    tokens = rng.integers(0, sizes["vocab"], size=(batch_size, sizes["length"] + 1))
    batch = {"tokens": jnp.asarray(tokens, jnp.int32)}
    variables = model.init(jax.random.key(0), batch["tokens"][:1, :-1], train=False)

    def per_example(params, model_state, rows, weights, rng):
      del weights, rng
      logits = model.apply({"params": params}, rows["tokens"][:, :-1], train=False)
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, rows["tokens"][:, 1:])
      return jnp.mean(losses, axis=1), model_state

    return Workload(variables["params"], {}, batch, per_example)

  channels = 1 if name in ("mlp", "cnn") else 3
  image = sizes.get("image", 28)
  batch = {
    "image": jnp.asarray(rng.normal(size=(batch_size, image, image, channels)), jnp.float32),
    "label": jnp.asarray(rng.integers(0, 10, size=batch_size), jnp.int32),
  }
  if name == "resnet18":
    resnet = models.ResNet(
      stage_sizes=tuple(sizes["stages"]),
      block_cls=models.ResNetBlock,
      num_classes=10,
      num_filters=sizes["width"],
      stem="cifar",
    )
    variables = resnet.init(jax.random.key(0), batch["image"][:1], train=False)
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}

    def per_example(params, model_state, rows, weights, rng):
      del rng
      logits, new_state = resnet.apply(
        {"params": params, **model_state},
        rows["image"],
        train=True,
        mask=weights > 0,
        mutable=list(model_state),
      )
      return optax.softmax_cross_entropy_with_integer_labels(logits, rows["label"]), new_state

    return Workload(params, model_state, batch, per_example)

  if name == "cnn4":
    net: nn.Module = FourStageCNN(tuple(sizes["channels"]))
  elif name == "mlp":
    net = SmallNet(widths=tuple(sizes["widths"]))
  elif name == "cnn":
    net = SmallNet(channels=tuple(sizes["channels"]))
  else:
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
  params = net.init(jax.random.key(0), batch["image"][:1])["params"]

  def per_example_image(params, model_state, rows, weights, rng):
    del weights, rng
    logits = net.apply({"params": params}, rows["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, rows["label"]), model_state

  return Workload(params, {}, batch, per_example_image)


def _adamw() -> optax.GradientTransformation:
  return optax.adamw(1e-3, weight_decay=1e-4)


# Every step's first three arguments are its state (parameters, optimizer state, model state, in
# the step's order), donated; its first three outputs are the same state, the next call's.
STATE_ARGNUMS = (0, 1, 2)


def call_with_state(compiled: Any, args: list) -> Any:
  """Calls ``compiled`` on ``args`` and waits for its outputs; the new state (the first three
  outputs) replaces the donated state in ``args``, for the next call. Returns the outputs."""
  outputs = jax.block_until_ready(compiled(*args))
  args[: len(STATE_ARGNUMS)] = outputs[: len(STATE_ARGNUMS)]
  return outputs


class _Step(NamedTuple):
  """A compiled step, its arguments (a list: each call's new state replaces the donated one),
  and how to read its similarity from its outputs."""

  compiled: Any
  args: list
  similarity: Callable[[Any], float] | None  # None: a step that measures none.
  compile_seconds: float
  # The programs a cycle runs before this step's own, on the same arguments (measure_every's plain
  # steps); the cycle is timed against as many plain steps as it makes calls.
  before: tuple[Any, ...] = ()

  def run_seconds(self) -> float:
    """The seconds of one cycle: the calls before, then the step's own, each waited for."""
    start = time.perf_counter()
    for compiled in (*self.before, self.compiled):
      call_with_state(compiled, self.args)
    return time.perf_counter() - start


def _compile(fn: Callable[..., Any], args: tuple, similarity: Any) -> _Step:
  """``fn`` compiled with its state donated, on a copy of ``args``'s state (the workload's
  arrays stay whole for the other steps)."""
  state = len(STATE_ARGNUMS)
  args = [*jax.tree.map(jnp.copy, args[:state]), *args[state:]]
  start = time.perf_counter()
  compiled = jax.jit(fn, donate_argnums=STATE_ARGNUMS).lower(*args).compile()
  return _Step(compiled, args, similarity, time.perf_counter() - start)


def make_step(name: str, workload: Workload) -> _Step:
  """Compiles the step ``name`` (one of :data:`STEPS`) of ``workload``."""
  params, model_state, batch, per_example = workload
  rows = jax.tree.leaves(batch)[0].shape[0]
  ones = jnp.ones((rows,), jnp.float32)
  key = jax.random.key(0)

  def mean_loss(p, rows_of, state):
    count = jax.tree.leaves(rows_of)[0].shape[0]
    losses, new_state = per_example(p, state, rows_of, jnp.ones((count,), jnp.float32), key)
    return jnp.mean(losses), new_state

  if name == "plain":
    adamw = _adamw()

    def plain(p, state, opt_state, rows_of):
      (value, new_state), grads = jax.value_and_grad(mean_loss, has_aux=True)(p, rows_of, state)
      updates, opt_state = adamw.update(grads, opt_state, p)
      return optax.apply_updates(p, updates), new_state, opt_state, value

    return _compile(plain, (params, model_state, adamw.init(params), batch), None)

  family, passes = name.split("_", 1)
  if family == "halves":
    optimizer = optax.chain(simigrad_jax.transform(), _adamw())
    value_and_half_grads = simigrad_jax.value_and_half_grads(
      mean_loss, has_aux=True, batch_argnums=1, passes=passes
    )

    def halves(p, state, opt_state, rows_of):
      (value, new_states), grads, half_grads = value_and_half_grads(p, rows_of, state)
      updates, opt_state = optimizer.update(grads, opt_state, p, half_grads=half_grads)
      new_state = jax.tree.map(lambda s: jnp.mean(s, axis=0), new_states)
      return optax.apply_updates(p, updates), new_state, opt_state, value

    args = (params, model_state, optimizer.init(params), batch)
    return _compile(halves, args, lambda out: simigrad_jax.similarity(out[2]))

  if name.startswith("trainer_every_"):
    plain_program = make_step("trainer_plain", workload)
    measuring = make_step("trainer_sequential", workload)
    cycle = (plain_program.compiled,) * (MEASURE_EVERY - 1)  # on the measuring step's state
    seconds = plain_program.compile_seconds + measuring.compile_seconds
    return measuring._replace(compile_seconds=seconds, before=cycle)

  optimizer = optax.chain(
    simigrad_jax.transform("data"), _adamw(), simigrad_jax.scale_by_lr_factor()
  )
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  if passes == "plain":
    step = train_step.make_plain_step(per_example, optimizer, mesh, "data")
  else:
    step = train_step.make_fused_step(
      per_example, optimizer, mesh, "data", halves="local", passes=passes
    )
  scalars = train_step.StepScalars(
    total_weight=np.float32(rows), lr_factor=np.float32(1.0), first_half_weight=np.float32(rows / 2)
  )
  counters = np.zeros(2, np.int32)
  args = (params, optimizer.init(params), model_state, batch, ones, scalars, counters)
  if passes == "plain":
    return _compile(step, args, None)
  return _compile(step, args, lambda out: simigrad_jax.similarity(out[3].similarity_state))


def measure_pair(step: _Step, plain: _Step, rounds: int, gradient_bytes: int) -> dict[str, Any]:
  """One step against the plain step: paired times, temporary memory, and its similarity."""
  outputs = call_with_state(step.compiled, step.args)
  similarity = None if step.similarity is None else float(step.similarity(outputs))
  step.run_seconds()  # every program of a cycle run once before the timed rounds
  plain.run_seconds()
  # (0 where XLA gives no memory analysis.)
  temp, plain_temp = timing.temp_bytes(step.compiled) or 0, timing.temp_bytes(plain.compiled) or 0
  calls = 1 + len(step.before)
  paired = timing.against_plain(
    step.run_seconds,
    lambda: sum(plain.run_seconds() for _ in range(calls)),
    rounds,
    temp=temp,
    plain_temp=plain_temp,
  )
  for key in ("step_seconds", "plain_step_seconds"):  # per step, a cycle's too
    paired[key] /= calls
  return {
    **paired,
    "calls": calls,
    "extra_temp_gradients": (temp - plain_temp) / gradient_bytes,
    "compile_seconds": step.compile_seconds,
    "similarity": similarity,
  }


def run(
  workloads: Sequence[str],
  steps: Sequence[str],
  size: str,
  rounds: int,
  out: str | None,
) -> dict[str, Any]:
  """Measures every step of every workload, rewriting ``out`` after each one.

  Returns:
    ``{"size", "rounds", "device", "sizes", "workloads": {workload:
    {"parameters", "gradient_bytes", "steps": {step: row}}}}``, each row as
    :func:`measure_pair` returns it (the plain step's own row too: ratio 1).
  """
  results: dict[str, Any] = {
    "size": size,
    "rounds": rounds,
    "device": common.device_record(),
    # As the JSON reads back (lists, not tuples).
    "sizes": json.loads(json.dumps({name: SIZES[size][name] for name in workloads})),
    "workloads": {},
  }

  def save() -> None:
    if out:
      os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
      with open(out, "w") as f:
        json.dump(results, f, indent=2)

  for workload_name in workloads:
    workload = make_workload(workload_name, SIZES[size][workload_name])
    leaves = jax.tree.leaves(workload.params)
    gradient_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    part = results["workloads"][workload_name] = {
      "parameters": sum(leaf.size for leaf in leaves),
      "gradient_bytes": gradient_bytes,
      "steps": {},
    }
    plain = make_step("plain", workload)
    for step_name in steps:
      step = plain if step_name == "plain" else make_step(step_name, workload)
      part["steps"][step_name] = measure_pair(step, plain, rounds, gradient_bytes)
      save()
      row = part["steps"][step_name]
      print(
        f"{workload_name:<9} {step_name:<19} {row['paired_time_ratio']:6.2f}x time "
        f"{row['temp_ratio'] or float('nan'):6.2f}x temp  similarity {row['similarity']}",
        flush=True,
      )
  return results


def format_table(results: dict[str, Any]) -> str:
  """The text table: per workload and step, time and temporary memory against the plain step."""
  header = (
    f"{'workload':<9} {'step':<19}{'time':>8}{'temp':>8}{'+grads':>8}{'plain ms':>10}"
    f"{'similarity':>12}"
  )
  lines = [header, "-" * len(header)]
  for workload, part in results["workloads"].items():
    for name, row in part["steps"].items():
      similarity = row["similarity"]
      lines.append(
        f"{workload:<9} {name:<19}{row['paired_time_ratio']:>7.2f}x"
        f"{row['temp_ratio'] or float('nan'):>7.2f}x{row['extra_temp_gradients']:>8.2f}"
        f"{1e3 * row['plain_step_seconds']:>10.2f}"
        f"{'-' if similarity is None else f'{similarity:.6f}':>12}"
      )
  return "\n".join(lines)


def markdown_table(results: dict[str, Any]) -> str:
  """docs/results.md's tables of a run: :func:`passes_markdown_table` where a step of
  :data:`PASSES_STEPS` ran, :func:`every_markdown_table` where one of :data:`EVERY_STEPS` ran,
  a blank line between them."""
  ran = {name for part in results["workloads"].values() for name in part["steps"]}
  tables = [
    table(results)
    for steps, table in ((PASSES_STEPS, passes_markdown_table), (EVERY_STEPS, every_markdown_table))
    if ran & set(steps)
  ]
  return "\n\n".join(tables)


def passes_markdown_table(results: dict[str, Any]) -> str:
  """docs/results.md's passes table: per workload, each step's time / plain and extra
  temporaries.

  Each cell is ``time / plain, temporaries beyond the plain step's in
  gradients`` (``-`` where a step did not run).
  """
  names = list(PASSES_STEPS)
  lines = [
    "| workload | plain step | " + " | ".join(f"`{name}`" for name in names) + " |",
    "|---|---|" + "---|" * len(names),
  ]
  for workload, part in results["workloads"].items():
    rows = part["steps"]
    any_row = next(iter(rows.values()))
    cells = [
      f"{rows[name]['paired_time_ratio']:.2f}x, {rows[name]['extra_temp_gradients']:+.2f} g"
      if name in rows
      else "-"
      for name in names
    ]
    plain = f"{1e3 * any_row['plain_step_seconds']:.1f} ms"
    lines.append(f"| {workload} | {plain} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def every_markdown_table(results: dict[str, Any]) -> str:
  """docs/results.md's ``measure_every`` table: per workload, the Trainer's plain program and
  the cycle of ``measure_every=4`` against the plain step (time / plain; the plain program's
  temporaries beyond the plain step's in gradients), and the goal (at most 1.05x)."""
  plain_program, cycle = EVERY_STEPS
  lines = [
    f"| workload | plain step | `{plain_program}` | `{cycle}` | at most 1.05x |",
    "|---|---|---|---|---|",
  ]
  for workload, part in results["workloads"].items():
    rows = part["steps"]
    if cycle not in rows:
      continue
    plain = f"{1e3 * rows[cycle]['plain_step_seconds']:.1f} ms"
    own = rows.get(plain_program)
    own_cell = (
      "-"
      if own is None
      else f"{own['paired_time_ratio']:.2f}x, {own['extra_temp_gradients']:+.2f} g"
    )
    ratio = rows[cycle]["paired_time_ratio"]
    met = "met" if ratio <= 1.05 else "missed"
    lines.append(f"| {workload} | {plain} | {own_cell} | {ratio:.2f}x | {met} |")
  return "\n".join(lines)


def _choices(allowed: Sequence[str], flag: str) -> Callable[[str], tuple[str, ...]]:
  def parse(text: str) -> tuple[str, ...]:
    chosen = tuple(part for part in text.split(",") if part)
    unknown = [part for part in chosen if part not in allowed]
    if unknown or not chosen:
      raise argparse.ArgumentTypeError(
        f"{flag} {text!r}: expected some of {','.join(allowed)}, comma-separated"
      )
    return chosen

  return parse


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", choices=tuple(SIZES), default="full", help="the workloads' sizes")
  parser.add_argument(
    "--workloads",
    type=_choices(WORKLOADS, "--workloads"),
    default=WORKLOADS,
    help=f"which workloads, in this order (default {','.join(WORKLOADS)})",
  )
  parser.add_argument(
    "--steps",
    type=_choices(STEPS, "--steps"),
    default=STEPS,
    help=f"which steps (default all: {','.join(STEPS)})",
  )
  parser.add_argument("--rounds", type=int, default=None, help="paired timed rounds per step")
  parser.add_argument(
    "--markdown", default=None, help="print the docs table of this JSON, and stop"
  )
  common.add_out_flag(parser, "one_device_steps", quick=False)
  args = parser.parse_args(argv)
  if args.rounds is None:
    args.rounds = SIZES[args.size]["rounds"]
  if args.rounds <= 0:
    parser.error(f"--rounds {args.rounds}: expected a positive number of rounds")
  if args.out is None:
    suffix = {"full": "", "reduced": "_cpu", "tiny": "_tiny"}[args.size]
    args.out = common.out_path(None, f"one_device_steps{suffix}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark (or prints the docs table of a JSON with ``--markdown``).

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    What :func:`run` returns, or ``{}`` with ``--markdown``.
  """
  args = _parse_args(argv)
  if args.markdown:
    with open(args.markdown, encoding="utf-8") as f:
      print(markdown_table(json.load(f)))
    return {}
  results = run(args.workloads, args.steps, args.size, args.rounds, args.out)
  return common.report(results, format_table(results), args.out)


if __name__ == "__main__":
  main(sys.argv[1:])
