"""In-graph: a plain ``jax.jit`` step whose halves are the even and odd devices of the data axis.

:func:`device_halves_step` builds the step of an own training loop on a mesh
with a data axis and, optionally, model axes: inside one ``jax.shard_map``
that is manual over the data axis only, each device takes the gradient of its
own rows and :func:`simigrad_jax.transform` (named for the data axis) reduces
the devices' gradients as the reference implementation does, the even
devices against the odd ones, for the bytes of one all-reduce. The model axes
stay with XLA's partitioner, so the loss is written as for a plain ``jit``
step, and no row or activation moves between devices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from simigrad_jax.ingraph import group_reduction
from simigrad_jax.ingraph import transform as transform_lib

Step = Callable[[Any, Any, Any], tuple[Any, ...]]


def _mesh_with(axis_name: str) -> jax.sharding.AbstractMesh:
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or axis_name not in mesh.axis_names:
    found = "no mesh" if mesh.empty else f"a mesh with the axes {tuple(mesh.axis_names)}"
    raise ValueError(
      f"device_halves_step(axis_name={axis_name!r}) runs its step over a mesh axis "
      f"{axis_name!r}, and found {found}: call the jitted step inside "
      f"`with jax.set_mesh(mesh):`, mesh having an axis {axis_name!r}, or name the data axis "
      "with axis_name="
    )
  if mesh.shape[axis_name] % 2:
    raise ValueError(
      f"device_halves_step compares the even and odd devices of the axis {axis_name!r}, "
      f"which has {mesh.shape[axis_name]} (an odd number): on an odd data axis use "
      "simigrad_jax.value_and_half_grads and simigrad_jax.transform() (no axis name) in a "
      "plain jax.jit step, which compare the even- and odd-numbered examples of every device"
    )
  return mesh


def _explicit(mesh: jax.sharding.AbstractMesh) -> bool:
  return AxisType.Explicit in mesh.axis_types


def _without_axis(spec: P, axis_name: str) -> P:
  """``spec`` with ``axis_name`` taken out of every entry."""

  def kept(entry: Any) -> Any:
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    left = tuple(name for name in names if name != axis_name)
    return left[0] if len(left) == 1 else (left or None)

  return P(*(kept(entry) for entry in spec))


def _gathered_over(tree: Any, axis_name: str) -> tuple[Any, Any]:
  """Explicit axes: each leaf resharded without ``axis_name`` (FSDP gathered); its old specs."""
  specs = jax.tree.map(lambda leaf: jax.typeof(leaf).sharding.spec, tree)
  gathered = jax.tree.map(
    lambda leaf, spec: jax.sharding.reshard(leaf, _without_axis(spec, axis_name)),
    tree,
    specs,
    is_leaf=lambda x: isinstance(x, jax.Array),
  )
  return gathered, specs


def _mean_over(tree: Any, axis_name: str) -> Any:
  """The floating leaves of ``tree`` averaged over ``axis_name``; the others as they are."""
  return jax.tree.map(
    lambda x: lax.pmean(x, axis_name) if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x,
    tree,
  )


def device_halves_step(
  loss_fn: Callable[..., Any],
  optimizer: optax.GradientTransformation,
  *,
  axis_name: str = "data",
  has_aux: bool = False,
  param_specs: Any = None,
) -> Step:
  """Builds a step for ``jax.jit`` whose halves are the data axis's even and odd devices.

  Each device of the data axis takes the gradient of its own rows of the
  batch, and the optimizer, which chains ``simigrad_jax.transform(axis_name)``,
  compares the even devices' mean gradient with the odd devices' and
  averages them (the bytes of one all-reduce of the gradient: the plain
  step's). It all runs in one ``jax.shard_map`` that is manual over
  ``axis_name`` only: model axes stay with XLA's partitioner, so
  ``loss_fn`` is written as for a plain ``jax.jit`` step over one device's
  rows, and tensor-parallel leaves keep their sharding. Parameters sharded
  over the data axis itself (FSDP) are gathered at the step's entry and
  sharded again at its exit (under ``Explicit`` axes; under ``Auto`` axes the
  step returns them replicated over the data axis, for ``jax.jit``'s
  ``out_shardings`` to lay out).

  Call the step inside ``jax.jit`` and ``with jax.set_mesh(mesh):``, with the
  batch's leaves sharded over ``axis_name`` on their leading axis. The
  halves are the even data positions' rows and the odd ones': order a
  global batch with :func:`simigrad_jax.deal_to_devices` to make them the
  batch's even- and odd-numbered examples.

  Args:
    loss_fn: ``loss_fn(params, batch)`` -> a scalar mean loss over the rows
      it is given (with ``has_aux``, ``(loss, aux)``).
    optimizer: an optax optimizer that chains ``simigrad_jax.transform(axis_name)``.
    axis_name: the mesh's data axis; its size must be even.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; the step returns ``aux`` too,
      its floating leaves averaged over the data axis.
    param_specs: under ``Auto`` mesh axes, the parameters' ``PartitionSpec``
      (a pytree like ``params``), which their types do not carry there: with
      them each device reduces its own shards of tensor-parallel gradients;
      without them those are gathered whole over the model axes. Under
      ``Explicit`` axes the types say it, and this is not needed.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, loss)`` (``(params,
    opt_state, loss, aux)`` with ``has_aux``), ``loss`` averaged over the
    data axis.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, simigrad_jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> optimizer = optax.chain(simigrad_jax.transform("data"), optax.sgd(0.1))
    >>> loss_fn = lambda w, batch: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> step = jax.jit(simigrad_jax.device_halves_step(loss_fn, optimizer))
    >>> x = np.ones((16, 3), np.float32)
    >>> batch = jax.device_put({"x": x, "y": x.sum(1)}, NamedSharding(mesh, P("data")))
    >>> w = jnp.zeros(3)
    >>> with jax.set_mesh(mesh):
    ...   w, opt_state, loss = step(w, optimizer.init(w), batch)
  """
  if not isinstance(axis_name, str) or not axis_name:
    raise ValueError(
      f"axis_name={axis_name!r} is not valid: give the name of the mesh's data axis "
      "(a non-empty string, such as 'data')"
    )

  def per_device(params: Any, opt_state: Any, batch: Any) -> tuple[Any, ...]:
    # check_vma=False: the gradient of the parameters passed with P() is this device's own.
    value, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)
    with transform_lib.step_mapped_over(axis_name):
      updates, opt_state = optimizer.update(grads, opt_state, params)
    loss, aux = value if has_aux else (value, None)
    outputs = (optax.apply_updates(params, updates), opt_state, lax.pmean(loss, axis_name))
    return outputs + ((_mean_over(aux, axis_name),) if has_aux else ())

  def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, ...]:
    mesh = _mesh_with(axis_name)
    over_data = jax.shard_map(
      per_device,
      in_specs=(P(), P(), P(axis_name)),
      out_specs=P(),
      axis_names={axis_name},
      check_vma=False,
    )
    if not _explicit(mesh):
      specs = None
      if param_specs is not None:
        specs = jax.tree.map(
          lambda spec: _without_axis(spec, axis_name),
          param_specs,
          is_leaf=lambda x: isinstance(x, P),
        )
      with group_reduction.gradient_specs(specs):
        return over_data(params, opt_state, batch)
    # Explicit axes: JAX lowers a shard_map's P() inputs as replicated over the other
    # explicit axes too (a tensor-parallel kernel gathered whole); run it with those axes
    # Auto, the leaves laid out as before, and give the reduction their specs.
    params, placed_specs = _gathered_over(params, axis_name)
    opt_state, state_specs = _gathered_over(opt_state, axis_name)
    batch = jax.tree.map(lambda leaf: jax.sharding.reshard(leaf, P(axis_name)), batch)
    others = tuple(name for name in mesh.axis_names if name != axis_name)
    inner_specs = jax.tree.map(lambda spec: _without_axis(spec, axis_name), placed_specs)
    inner_state = jax.tree.map(lambda spec: _without_axis(spec, axis_name), state_specs)
    scalars = (P(),) * (2 if has_aux else 1)
    batch_specs = jax.tree.map(lambda leaf: P(), batch)

    def per_device_explicit(params: Any, opt_state: Any, batch: Any) -> tuple[Any, ...]:
      # Inside, the other axes are Explicit again, so the loss names them as in a plain step.
      return jax.sharding.explicit_axes(
        per_device, axes=others, in_sharding=(inner_specs, inner_state, batch_specs)
      )(params, opt_state, batch)

    over_data = jax.shard_map(
      per_device_explicit,
      in_specs=(P(), P(), P(axis_name)),
      out_specs=P(),
      axis_names={axis_name},
      check_vma=False,
    )
    with group_reduction.gradient_specs(inner_specs):
      outputs = jax.sharding.auto_axes(
        over_data, axes=others, out_sharding=(inner_specs, inner_state) + scalars
      )(params, opt_state, batch)
    new_params = jax.tree.map(jax.sharding.reshard, outputs[0], placed_specs)
    new_state = jax.tree.map(jax.sharding.reshard, outputs[1], state_specs)
    return (new_params, new_state) + tuple(outputs[2:])

  return step
