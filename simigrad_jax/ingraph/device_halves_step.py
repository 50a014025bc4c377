"""In-graph: a plain ``jax.jit`` step whose halves are the even and odd devices of the data axis.

:func:`device_halves_step` builds the step of an own training loop on a mesh
with a data axis and, optionally, model axes: in a ``jax.shard_map`` that is
manual over the data axis only, each device takes the gradient of its own
rows; :func:`simigrad_jax.transform` (named for the data axis) then reduces
the devices' gradients as the reference implementation does, the even
devices against the odd ones, for the bytes of one all-reduce, into the
parameters' own layout (FSDP blocks stay blocks), and the rest of the
optimizer runs on global arrays. The model axes stay with XLA's
partitioner, so the loss is written as for a plain ``jit`` step, and no row
or activation moves between devices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from simigrad_jax.ingraph.transform import StackedGrads
from simigrad_jax.reductions import data_blocks

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


def _mean_over(tree: Any, axis_name: str) -> Any:
  """The floating leaves of ``tree`` averaged over ``axis_name``; the others as they are."""
  return jax.tree.map(
    lambda x: lax.pmean(x, axis_name) if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x,
    tree,
  )


def update_stacked(
  optimizer: optax.GradientTransformation,
  stacked: Any,
  opt_state: Any,
  params: Any,
  stacked_grads: StackedGrads,
  param_specs: Any,
  who: str,
  **outputs: Any,
) -> tuple[Any, Any]:
  """``optimizer.update`` on the devices' stacked gradients, told so in the call.

  Passes ``stacked_grads`` and ``param_specs`` to the update (``optax.chain``
  passes them on to :func:`simigrad_jax.transform`), and refuses an optimizer
  that never reached the transform: its updates would still hold one
  gradient per device.

  Args:
    optimizer: the optimizer, :func:`simigrad_jax.transform` first in its chain.
    stacked: each device's gradient, stacked along a leading dimension sharded
      over ``stacked_grads.axis_name``.
    opt_state: the optimizer's state.
    params: the parameters.
    stacked_grads: the :class:`~simigrad_jax.ingraph.transform.StackedGrads`
      that describes ``stacked``.
    param_specs: the parameters' ``PartitionSpec``s, or None.
    who: the step, for the errors.
    **outputs: ``record_outputs=`` or ``replay_outputs=`` (a
      :class:`~simigrad_jax.ingraph.transform.RecordedOutputs`), passed on to
      the update.

  Returns:
    ``(updates, new_opt_state)``.
  """
  axis_name = stacked_grads.axis_name
  if not isinstance(optimizer, optax.GradientTransformationExtraArgs):
    raise ValueError(
      f"{who}'s optimizer never reached simigrad_jax.transform({axis_name!r}): its update "
      "takes no extra keyword arguments, so it cannot be handed stacked_grads=...; chain it, "
      f"optax.chain(simigrad_jax.transform({axis_name!r}), ...)"
    )
  updates, new_opt_state = optimizer.update(
    stacked, opt_state, params, stacked_grads=stacked_grads, param_specs=param_specs, **outputs
  )
  data_blocks.check_reduced(updates, params, axis_name, who)
  return updates, new_opt_state


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
  batch inside a ``jax.shard_map`` that is manual over ``axis_name`` only:
  model axes stay with XLA's partitioner, so ``loss_fn`` is written as for a
  plain ``jax.jit`` step over one device's rows, and tensor-parallel leaves
  keep their sharding. The optimizer then runs on global arrays, as in a
  plain step (a global-norm clip sees the whole gradient): its
  ``simigrad_jax.transform(axis_name)``, which must come first in the chain,
  is handed the devices' gradients stacked, and told so in the call
  (``optimizer.update(stacked, opt_state, params, stacked_grads=StackedGrads(
  axis_name), param_specs=specs)``, which ``optax.chain`` passes on to it); it
  compares the even devices' mean gradient with the odd devices' and
  averages them (the bytes of one all-reduce of the gradient: the plain
  step's), and returns the mean laid out as the parameters are. Parameters
  sharded over the data axis alone on one dimension (FSDP) enter as their
  blocks and are gathered for the loss; their mean gradient is
  reduce-scattered into the same blocks, so the update and the optimizer
  state stay in blocks. A parameter whose spec names the data axis together
  with another axis on one dimension is gathered whole instead.

  Call the step inside ``jax.jit`` and ``with jax.set_mesh(mesh):``, with the
  batch's leaves sharded over ``axis_name`` on their leading axis. The
  halves are the even data positions' rows and the odd ones': order a
  global batch with :func:`simigrad_jax.data.deal_to_devices` to make them the
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
      them each device reduces its own shards of tensor-parallel gradients
      and keeps FSDP blocks; without them the parameters are taken as
      replicated over the data axis (FSDP leaves gathered whole for the
      step) and tensor-parallel gradients are gathered over the model axes.
      Under ``Explicit`` axes the types say it, and this is not needed.

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

  def per_device(params: Any, batch: Any) -> tuple[Any, ...]:
    # check_vma=False: the gradient of the parameters passed with P() is this device's own.
    value, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)
    loss, aux = value if has_aux else (value, None)
    stacked = jax.tree.map(lambda g: g[None], grads)  # a leading data dimension: no copy
    return (stacked, lax.pmean(loss, axis_name)) + (
      (_mean_over(aux, axis_name),) if has_aux else ()
    )

  def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, ...]:
    mesh = _mesh_with(axis_name)
    explicit = _explicit(mesh)
    if explicit:
      specs = jax.tree.map(lambda leaf: jax.typeof(leaf).sharding.spec, params)
    else:
      specs = param_specs
    blocks = data_blocks.DataBlocks(params, specs, axis_name)
    scalars = (P(),) * (2 if has_aux else 1)
    others = tuple(name for name in mesh.axis_names if name != axis_name)

    def device_gradients(params: Any, batch: Any) -> tuple[Any, ...]:
      whole = blocks.gather(params)
      if not explicit:
        return per_device(whole, batch)
      # Inside, the other axes are Explicit again, so the loss names them as in a plain step.
      batch_specs = jax.tree.map(lambda leaf: P(), batch)
      return jax.sharding.explicit_axes(
        per_device, axes=others, in_sharding=(blocks.inner, batch_specs)
      )(whole, batch)

    over_data = jax.shard_map(
      device_gradients,
      in_specs=(blocks.entry, P(axis_name)),
      out_specs=(P(axis_name),) + scalars,
      axis_names={axis_name},
      check_vma=False,
    )

    if explicit:
      # JAX lowers a shard_map's P() inputs as replicated over the other explicit axes too (a
      # tensor-parallel kernel gathered whole): run it with those axes Auto.
      entered = jax.tree.map(
        lambda leaf, spec, d: leaf if d is not None else jax.sharding.reshard(leaf, spec),
        params,
        blocks.mean,
        blocks.dims,
        is_leaf=lambda x: x is None,
      )
      batch = jax.tree.map(lambda leaf: jax.sharding.reshard(leaf, P(axis_name)), batch)
      stacked_specs = jax.tree.map(
        lambda spec: P(axis_name, *spec), blocks.inner, is_leaf=data_blocks.is_spec
      )
      outputs = jax.sharding.auto_axes(
        over_data, axes=others, out_sharding=(stacked_specs,) + scalars
      )(entered, batch)
    else:
      outputs = over_data(params, batch)
    updates, opt_state = update_stacked(
      optimizer, outputs[0], opt_state, params, StackedGrads(axis_name), specs, "device_halves_step"
    )
    return (optax.apply_updates(params, updates), opt_state) + tuple(outputs[1:])

  return step
