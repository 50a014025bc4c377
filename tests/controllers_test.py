"""Controllers by name: the registry the trainer and the train configs use."""

import pytest

import simigrad_jax


def test_simigrad_by_name_is_the_reference_controller():
  controller = simigrad_jax.make_controller("simigrad", initial_batch_size=128, similarity_target=0.1)
  assert isinstance(controller, simigrad_jax.Controller)
  assert controller.update(0.0) == 140  # below target: max(B + 1, int(B * 1.1))


def test_fixed_never_moves_and_still_counts():
  controller = simigrad_jax.make_controller("fixed", initial_batch_size=96)
  assert [controller.update(s) for s in (-1.0, 0.0, 0.9, float("nan"))] == [96] * 4
  assert controller.last_decision == "nonfinite" and controller.nonfinite_count == 1


def test_unknown_name_and_duplicate_registration_are_refused():
  with pytest.raises(ValueError, match=r"unknown controller 'adaptive'; choose one of \(.*'fixed'.*'simigrad'"):
    simigrad_jax.make_controller("adaptive", initial_batch_size=8)
  with pytest.raises(ValueError, match="'fixed' is already registered"):
    simigrad_jax.register_controller("fixed", simigrad_jax.Controller)
