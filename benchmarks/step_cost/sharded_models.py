"""The models, layouts and steps of benchmarks/step_cost/sharded.py: dense ReLU networks on a mesh.

A model is a stack of dense layers given by its widths (``(8192, 8192, 10)``:
one 8192x8192 kernel and a 10-way head; ``(784, 1024, 1024, 10)``: an MLP),
ReLU between layers and softmax cross-entropy at the end. Its parameters are
laid out on a mesh in one of four ways (:data:`LAYOUTS`), with ``Auto`` or
``Explicit`` mesh axes, and the batch is always sharded over the ``data`` axis.

Under ``Explicit`` axes the model says what ``Auto`` leaves to XLA's
partitioner: an FSDP kernel is gathered over ``data`` before its layer
(``jax.sharding.reshard``), and each matrix product names where its output
lies (rows over ``data``; columns where the kernel's columns are). The
gradient is then that of the same function in either mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import simigrad_jax

# Layout -> mesh shape over ("data",) or ("data", "model").
LAYOUTS: dict[str, tuple[int, ...]] = {"data": (8,), "fsdp": (8,), "tp": (4, 2), "fsdp_tp": (4, 2)}
AXIS_TYPES: dict[str, AxisType] = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
VARIANTS = ("plain", "halves", "simigrad", "groups")
LEARNING_RATE = 0.1

Step = Callable[..., tuple[Any, Any, jax.Array]]


def make_mesh(layout: str, axes: str) -> jax.sharding.Mesh:
  """The mesh of ``layout`` (:data:`LAYOUTS`) over the first devices, with ``axes`` mesh axes."""
  shape = LAYOUTS[layout]
  names = ("data", "model")[: len(shape)]
  devices = jax.devices()[: int(np.prod(shape))]
  return jax.make_mesh(shape, names, axis_types=(AXIS_TYPES[axes],) * len(shape), devices=devices)


def layer_specs(widths: Sequence[int], layout: str) -> list[dict[str, P]]:
  """Each layer's ``{"kernel": spec, "bias": spec}`` under ``layout``.

  * ``data``: everything replicated;
  * ``fsdp``: every kernel's rows sharded over ``data``;
  * ``tp``: Megatron's pairs over ``model``: a column-parallel layer (kernel
    ``P(None, "model")``, bias ``P("model")``) then a row-parallel one
    (kernel ``P("model", None)``); a head left after the pairs is replicated;
  * ``fsdp_tp``: ``tp`` with each kernel's first axis that ``model`` leaves
    free, if ``data`` divides it, sharded over ``data`` (else its rows over
    ``model`` and ``data``).
  """
  num_layers = len(widths) - 1
  data_size = LAYOUTS[layout][0]
  specs = []
  for index in range(num_layers):
    if layout in ("data", "fsdp"):
      kernel, bias = [("data" if layout == "fsdp" else None), None], P()
    elif index % 2 == 0 and index < num_layers - 1:
      kernel, bias = [None, "model"], P("model")
    elif index % 2 == 1:
      kernel, bias = ["model", None], P()
    else:
      kernel, bias = [None, None], P()
    if layout == "fsdp_tp":
      shape = widths[index : index + 2]
      free = [axis for axis in (0, 1) if kernel[axis] is None and shape[axis] % data_size == 0]
      if free:
        kernel[free[0]] = "data"
      else:
        kernel[0] = (kernel[0], "data") if kernel[0] else "data"
    specs.append({"kernel": P(*kernel), "bias": bias})
  return specs


def init_params(widths: Sequence[int], seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
  """Float32 NumPy parameters: kernels ``N(0, 1 / fan_in)``, biases ``N(0, 0.01)``."""
  rng = np.random.default_rng(seed)
  return {
    f"layer_{i}": {
      "kernel": (rng.normal(size=(fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32),
      "bias": (0.01 * rng.normal(size=(fan_out,))).astype(np.float32),
    }
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:]))
  }


def make_batch(widths: Sequence[int], batch_size: int, seed: int = 1) -> dict[str, np.ndarray]:
  """Random inputs and labels that depend on them (a learnable task), as NumPy arrays."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch_size, widths[0])).astype(np.float32)
  teacher = rng.normal(size=(widths[0], widths[-1]))
  return {"x": x, "label": np.argmax(x @ teacher, axis=1).astype(np.int32)}


def place(params: Any, batch: Any, mesh: jax.sharding.Mesh, layout: str) -> tuple[Any, Any]:
  """The parameters laid out by ``layout`` and the batch sharded over ``data``, on ``mesh``."""
  widths = [params["layer_0"]["kernel"].shape[0]] + [
    params[f"layer_{i}"]["kernel"].shape[1] for i in range(len(params))
  ]
  specs = layer_specs(widths, layout)
  placed = {
    name: {
      key: jax.device_put(value, NamedSharding(mesh, specs[i][key])) for key, value in layer.items()
    }
    for i, (name, layer) in enumerate(sorted(params.items(), key=_layer_index))
  }
  return placed, jax.device_put(batch, NamedSharding(mesh, P("data")))


def _layer_index(item: tuple[str, Any]) -> int:
  return int(item[0].rsplit("_", 1)[1])


def _without_data(entry: Any) -> Any:
  """A spec entry with the ``data`` axis taken out."""
  names = (entry,) if isinstance(entry, str) else tuple(entry or ())
  kept = tuple(name for name in names if name != "data")
  return kept[0] if len(kept) == 1 else (kept or None)


def _dense(
  x: jax.Array, kernel: jax.Array, bias: jax.Array, explicit: bool, rows: str | None
) -> jax.Array:
  mesh = jax.sharding.get_abstract_mesh()
  if not explicit or AxisType.Explicit not in mesh.axis_types:
    # Auto axes; or Explicit ones turned Auto for the passes (value_and_half_grads on a mesh
    # of the data axis alone), where a spec may not name them.
    return x @ kernel + bias
  kernel_rows, columns = (tuple(jax.typeof(kernel).sharding.spec) + (None, None))[:2]
  gathered = P(_without_data(kernel_rows), _without_data(columns))
  kernel = jax.sharding.reshard(kernel, gathered)  # FSDP: gather the kernel over "data"
  return jnp.matmul(x, kernel, out_sharding=P(rows, gathered[1])) + bias


def make_loss(
  num_layers: int, explicit: bool, rows: str | None = "data"
) -> Callable[[Any, Any], jax.Array]:
  """``loss(params, batch)``: the mean softmax cross-entropy of the dense ReLU network.

  ``rows`` is the mesh axis the batch's rows lie on: ``"data"`` in a plain
  ``jax.jit`` step, None for one device's rows inside a ``jax.shard_map`` over it.
  """

  def loss(params, batch):
    x = batch["x"]
    for index in range(num_layers):
      layer = params[f"layer_{index}"]
      x = _dense(x, layer["kernel"], layer["bias"], explicit, rows)
      if index < num_layers - 1:
        x = jax.nn.relu(x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(x, batch["label"]))

  return loss


def make_steps(
  loss: Callable[[Any, Any], jax.Array],
  device_loss: Callable[[Any, Any], jax.Array],
  param_specs: Any = None,
) -> tuple[dict[str, Step], dict[str, optax.GradientTransformation]]:
  """The step of each variant and its optimizer, by name (:data:`VARIANTS`).

  * ``plain``: ``jax.value_and_grad`` of the mean loss and ``optax.sgd``;
  * ``halves``: :func:`simigrad_jax.value_and_half_grads` (the even- and the
    odd-numbered examples, one pass after the other) and ``optax.sgd`` on
    their mean, the similarity not measured: what the halves cost alone;
  * ``simigrad``: the same with ``simigrad_jax.transform()`` chained before
    ``optax.sgd``, given the two halves: the SimiGrad step;
  * ``groups``: :func:`simigrad_jax.device_halves_step` of ``device_loss``
    (the loss of one device's rows) with ``simigrad_jax.transform("data")``:
    the even data positions against the odd ones.

  ``param_specs``, the parameters' specs, for ``Auto`` axes (given to
  ``value_and_half_grads`` and ``device_halves_step``; None under ``Explicit``
  ones, whose types carry them).

  Each ``step(params, opt_state, batch) -> (params, opt_state, loss)``.
  """
  optimizers = {
    "plain": optax.sgd(LEARNING_RATE),
    "halves": optax.sgd(LEARNING_RATE),
    "simigrad": optax.chain(simigrad_jax.transform(), optax.sgd(LEARNING_RATE)),
    "groups": optax.chain(simigrad_jax.transform("data"), optax.sgd(LEARNING_RATE)),
  }

  def plain(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = optimizers["plain"].update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  def with_halves(name, pass_halves):
    def step(params, opt_state, batch):
      value, grads, halves = simigrad_jax.value_and_half_grads(loss, param_specs=param_specs)(
        params, batch
      )
      extra = {"half_grads": halves} if pass_halves else {}
      updates, opt_state = optimizers[name].update(grads, opt_state, params, **extra)
      return optax.apply_updates(params, updates), opt_state, value

    return step

  steps = {
    "plain": plain,
    "halves": with_halves("halves", False),
    "simigrad": with_halves("simigrad", True),
    "groups": simigrad_jax.device_halves_step(
      device_loss, optimizers["groups"], param_specs=param_specs
    ),
  }
  return steps, optimizers


def keeping_layout(step: Step, shardings: Any, axes: str) -> Step:
  """``step`` returning its new parameters in ``shardings``, as a training loop keeps them.

  Under ``Auto`` axes XLA would choose the new parameters' layout (a loop
  keeps it, as ``out_shardings`` would); under ``Explicit`` axes their types
  carry it and ``step`` is returned as is.
  """
  if axes != "auto":
    return step

  def run(params, opt_state, batch):
    new_params, opt_state, value = step(params, opt_state, batch)
    return jax.lax.with_sharding_constraint(new_params, shardings), opt_state, value

  return run


@dataclasses.dataclass(frozen=True)
class Placed:
  """One model, layout and kind of axes, on its mesh: what each benchmark compiles.

  Attributes:
    mesh: the layout's mesh (:func:`make_mesh`).
    params: the parameters laid out by the layout.
    batch: the batch, sharded over ``data``.
    steps: the variants' steps (:func:`make_steps`).
    optimizers: their optimizers.
    shardings: the parameters' shardings, for :func:`keeping_layout`.
  """

  mesh: jax.sharding.Mesh
  params: Any
  batch: Any
  steps: dict[str, Step]
  optimizers: dict[str, optax.GradientTransformation]
  shardings: Any


def place_model(
  widths: Sequence[int], layout: str, axes: str, host_params: Any, host_batch: Any
) -> Placed:
  """The mesh, the placed parameters and batch, and every variant's step of one configuration."""
  mesh = make_mesh(layout, axes)
  explicit = axes == "explicit"
  loss = make_loss(len(widths) - 1, explicit=explicit)
  device_loss = make_loss(len(widths) - 1, explicit=explicit, rows=None)
  params, batch = place(host_params, host_batch, mesh, layout)
  specs = jax.tree.map(lambda a: a.sharding.spec, params)
  steps, optimizers = make_steps(loss, device_loss, None if explicit else specs)
  return Placed(mesh, params, batch, steps, optimizers, jax.tree.map(lambda a: a.sharding, params))


def reference_similarity(
  widths: Sequence[int],
  params: Any,
  batch: Any,
  halves: tuple[Any, Any] = (slice(0, None, 2), slice(1, None, 2)),
) -> float:
  """``cos(g_A, g_B)`` in float64 on one device: g_A of the rows ``halves[0]`` (default the
  even-numbered examples), g_B of ``halves[1]`` (the odd)."""
  loss = make_loss(len(widths) - 1, explicit=False)
  with jax.enable_x64(True):
    params64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    grad = jax.jit(jax.grad(loss))

    def flat(rows):
      half = jax.tree.map(lambda a: a[rows], batch)
      return np.concatenate([np.ravel(g) for g in jax.tree.leaves(grad(params64, half))])

    g_a, g_b = flat(halves[0]), flat(halves[1])
    return float(g_a @ g_b / (np.linalg.norm(g_a) * np.linalg.norm(g_b)))
