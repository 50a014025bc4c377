"""The non-finite guard of the Trainer's steps: which cause a step records, and that a skipped
step leaves the parameters as they were, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from simigrad_jax.ingraph import train_step

BIG = np.float32(3e38)  # finite; twice it is not


def params():
  return {
    "w": jnp.array([[1.0, -0.0], [BIG, 2.0]], jnp.float32),  # a -0.0 entry, and one near the top
    "b": jnp.array([-0.0, 0.5, BIG], jnp.float32),
  }


def updates(w_entry=0.25, b_entry=0.25):
  return {
    "w": jnp.array([[0.25, 0.25], [w_entry, 0.25]], jnp.float32),
    "b": jnp.array([0.25, 0.25, b_entry], jnp.float32),
  }


def cause(upd, grads_finite=True, loss=1.0):
  p = params()
  code = jax.jit(train_step._nonfinite_cause)(
    jnp.asarray(grads_finite), jnp.float32(loss), upd, optax.apply_updates(p, upd)
  )
  return train_step.NONFINITE_CAUSES[int(code) - 1] if int(code) else None


@pytest.mark.parametrize(
  "upd, expected",
  [
    (updates(), None),
    (updates(w_entry=np.inf), "update"),
    (updates(b_entry=np.nan), "update"),
    (updates(w_entry=BIG), "parameters"),  # a finite update whose sum overflows
    (updates(b_entry=BIG), "parameters"),
    (updates(w_entry=BIG, b_entry=-np.inf), "update"),  # the update is named first
  ],
)
def test_each_leaf_s_update_and_new_values_name_the_cause(upd, expected):
  assert cause(upd) == expected


def test_the_gradient_and_the_loss_come_first():
  assert cause(updates(w_entry=np.inf), grads_finite=False) == "gradient"
  assert cause(updates(w_entry=np.inf), loss=np.nan) == "loss"


def test_a_frozen_leaf_s_none_update_counts_as_finite():
  upd = {"w": None, "b": updates()["b"]}
  p = params()
  code = train_step._nonfinite_cause(jnp.asarray(True), jnp.float32(1.0), upd, p)
  assert int(code) == 0


def write_if_finite(finite, upd):
  """The guard's write on params() and an optimizer state that counts its updates."""
  state = {"count": jnp.int32(3)}

  def optimizer_update(p, s):
    return upd, {"count": s["count"] + 1}

  return jax.jit(lambda f, p, s: train_step._write_if_finite(f, p, s, s, s, optimizer_update))(
    jnp.asarray(finite), params(), state
  )


def test_a_skipped_step_keeps_the_parameters_and_the_state_bit_for_bit():
  kept, state = write_if_finite(False, updates(w_entry=np.nan, b_entry=np.inf))
  for got, want in zip(jax.tree.leaves(kept), jax.tree.leaves(params()), strict=True):
    np.testing.assert_array_equal(np.asarray(got).view(np.int32), np.asarray(want).view(np.int32))
  assert int(state["count"]) == 3


def test_a_written_step_adds_the_update_and_writes_the_new_state():
  upd = updates()
  written, state = write_if_finite(True, upd)
  want = optax.apply_updates(params(), upd)
  for got, expected in zip(jax.tree.leaves(written), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(got, expected)
  assert int(state["count"]) == 4
