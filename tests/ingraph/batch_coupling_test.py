"""Adam coupled to the batch size: beta2 (Marek et al.), weight decay (Power Lines), no recompilation."""

import doctest
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import simigrad_jax
import tiny_run
from simigrad_jax.ingraph import batch_coupling
from simigrad_jax.ramps.token_schedules import StepScheduleController

B0, LR, BETA2, WD = 64, 1e-2, 0.95, 0.1
RULES = {"sqrt": math.sqrt, "linear": lambda r: r, "none": lambda r: 1.0}


def test_doctests():
  assert doctest.testmod(batch_coupling).failed == 0


def tree(seed):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros(3, jnp.float32)}


@pytest.mark.parametrize("lr_rule", sorted(RULES))
@pytest.mark.parametrize("optimizer", [optax.adamw, optax.lamb])
def test_each_update_is_the_optimizer_at_the_coupled_hyperparameters(lr_rule, optimizer):
  coupled = simigrad_jax.couple_to_batch_size(
    optimizer, B0, lr_rule=lr_rule, learning_rate=LR, b2=BETA2, weight_decay=WD
  )
  params = tree(0)
  state = coupled.init(params)
  update = jax.jit(coupled.update)
  reference_state = optimizer(LR, b2=BETA2, weight_decay=WD).init(params)
  for step, batch_size in enumerate([64, 256, 16, 100, 256]):
    grads = tree(step + 1)
    state = simigrad_jax.set_coupled_batch_size(state, batch_size)
    updates, state = update(grads, state, params)
    # The formulas: beta2^(B/B0) (Marek et al.), lambda * r / rule(r) (Power Lines).
    r = batch_size / B0
    b2, wd = BETA2**r, WD * r / RULES[lr_rule](r)
    hyper = state.inner_state.hyperparams
    assert float(hyper["b2"]) == pytest.approx(b2, rel=1e-6)
    assert float(hyper["weight_decay"]) == pytest.approx(wd, rel=1e-6)
    assert float(hyper["b1"]) == pytest.approx(0.9) and float(
      hyper["learning_rate"]
    ) == pytest.approx(LR)
    # The same moments under the plain optimizer at those hyperparameters.
    expected, reference_state = optimizer(LR, b2=b2, weight_decay=wd).update(
      grads, reference_state, params
    )
    jax.tree.map(
      lambda a, e: np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-7), updates, expected
    )
    params = optax.apply_updates(params, updates)


def test_a_new_batch_size_is_a_new_value_not_a_new_trace():
  traces = []
  coupled = simigrad_jax.couple_to_batch_size(
    optax.adamw, B0, learning_rate=LR, b2=BETA2, weight_decay=WD
  )

  def update(grads, state, params):
    traces.append(1)
    return coupled.update(grads, state, params)

  update = jax.jit(update)
  params, grads = tree(0), tree(1)
  state = coupled.init(params)
  seen = []
  for batch_size in (64, 128, 512, 32, 64):
    state = simigrad_jax.set_coupled_batch_size(state, batch_size)
    updates, new_state = update(grads, state, params)
    seen.append(float(new_state.inner_state.hyperparams["b2"]))
  assert len(traces) == 1 and update._cache_size() == 1
  assert len(set(seen)) == 4  # four batch sizes, four beta2 values (64 twice)


def test_what_can_be_coupled_is_checked():
  with pytest.raises(ValueError, match=r"base_batch_size must be an integer >= 1, got 0"):
    simigrad_jax.couple_to_batch_size(optax.adamw, 0, learning_rate=LR, b2=BETA2)
  with pytest.raises(ValueError, match=r"lr_rule='cubic' is not valid"):
    simigrad_jax.couple_to_batch_size(optax.adamw, 8, lr_rule="cubic", learning_rate=LR, b2=0.9)
  with pytest.raises(ValueError, match=r"coupling weight_decay needs weight_decay=<a number>"):
    simigrad_jax.couple_to_batch_size(optax.adam, 8, learning_rate=LR, b2=BETA2)
  # Values the coupling would turn into NaN, a second moment that never forgets, or weights that
  # grow: refused, naming the value (b2=nan was once taken, and every update was NaN).
  for b2 in (math.nan, 1.0, 1.5, -0.1, True):
    with pytest.raises(ValueError, match=rf"coupling b2 needs b2.*got {b2!r}"):
      simigrad_jax.couple_to_batch_size(optax.adamw, 8, learning_rate=LR, b2=b2, weight_decay=WD)
  for decay in (math.nan, math.inf, -0.1):
    with pytest.raises(ValueError, match=rf"coupling weight_decay needs .*got {decay!r}"):
      simigrad_jax.couple_to_batch_size(
        optax.adamw, 8, learning_rate=LR, b2=BETA2, weight_decay=decay
      )
  simigrad_jax.couple_to_batch_size(optax.adamw, 8, learning_rate=LR, b2=0.0, weight_decay=0)
  # NumPy's numbers are numbers (np.float32(0.99) was refused as "not a number"), coupled as
  # Python's are: the same beta2 and decay at every batch size.
  for base, b2, decay in ((8, BETA2, WD), (np.int64(8), np.float32(BETA2), np.float64(WD))):
    coupled = simigrad_jax.couple_to_batch_size(
      optax.adamw, base, learning_rate=LR, b2=b2, weight_decay=decay
    )
    state = simigrad_jax.set_coupled_batch_size(coupled.init(tree(0)), 32)
    _, state = coupled.update(tree(1), state, tree(0))
    hyperparams = state.inner_state.hyperparams
    assert float(hyperparams["b2"]) == pytest.approx(float(b2) ** 4, rel=1e-6)
    assert float(hyperparams["weight_decay"]) == pytest.approx(float(decay) * 2, rel=1e-6)
  only_beta2 = simigrad_jax.couple_to_batch_size(
    optax.adam, 8, couple_weight_decay=False, learning_rate=LR, b2=BETA2
  )
  state = simigrad_jax.set_coupled_batch_size(only_beta2.init(tree(0)), 16)
  _, state = only_beta2.update(tree(1), state)
  assert float(state.inner_state.hyperparams["b2"]) == pytest.approx(BETA2**2, rel=1e-6)
  with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1, got 0"):
    simigrad_jax.set_coupled_batch_size(state, 0)
  with pytest.raises(ValueError, match=r"no BatchCouplingState .*couple_to_batch_size"):
    simigrad_jax.set_coupled_batch_size(optax.adam(LR).init(tree(0)), 16)


def _run(workdir, couple, cache_dir):
  """The tiny Trainer run on a step schedule (8, 16, 32) with AdamW, coupled or not."""
  adamw = dict(learning_rate=LR, b2=BETA2, weight_decay=WD)
  inner = (
    simigrad_jax.couple_to_batch_size(optax.adamw, 8, **adamw) if couple else optax.adamw(**adamw)
  )
  optimizer = optax.chain(simigrad_jax.transform("batch"), inner, simigrad_jax.scale_by_lr_factor())
  controller = StepScheduleController("0:8,40:16,120:32")
  return tiny_run.train_records(workdir, cache_dir, 12, optimizer=optimizer, controller=controller)


def test_the_trainer_sets_each_steps_batch_size_without_compiling_more(tmp_path, devices):
  del devices
  cache = tmp_path / "cache"
  plain, _, plain_records = _run(tmp_path / "plain", False, cache)
  coupled, state, records = _run(tmp_path / "coupled", True, cache)
  sizes = [r["batch_size"] for r in records]
  assert sizes == [r["batch_size"] for r in plain_records] and set(sizes) == {8, 16, 32}
  # One compile per shape (which shapes depends on background-compile timing): the batch
  # sizes, beta2 and weight decay that changed between steps compiled nothing more.
  for summary in (plain, coupled):
    shapes = len(summary["compiled_step_sizes"]) + len(summary["compiled_accumulation_sizes"])
    assert summary["compiles"] == shapes + summary["update_compiled"], summary
  # The last step ran at 32 = 4 B0: its beta2 and weight decay were the coupled ones.
  (coupling,) = coupling_states(state)
  assert float(np.asarray(coupling.coupled_batch_size).reshape(-1)[0]) == sizes[-1] == 32
  hyper = {
    k: float(np.asarray(v).reshape(-1)[0]) for k, v in coupling.inner_state.hyperparams.items()
  }
  assert hyper["b2"] == pytest.approx(BETA2**4, rel=1e-6)
  assert hyper["weight_decay"] == pytest.approx(WD * 2, rel=1e-6)
  # The first step (at B0) is the plain one; later ones differ.
  losses, plain_losses = [r["loss"] for r in records], [r["loss"] for r in plain_records]
  assert losses[:2] == pytest.approx(plain_losses[:2], abs=1e-6)
  assert losses[-1] != pytest.approx(plain_losses[-1], abs=1e-6)


def coupling_states(opt_state):
  is_coupling = lambda n: isinstance(n, simigrad_jax.ingraph.BatchCouplingState)  # noqa: E731
  return [n for n in jax.tree.leaves(opt_state, is_leaf=is_coupling) if is_coupling(n)]


def test_the_train_configs_couple_adamw_and_lamb():
  from train import optimizers
  from train.configs import default

  config = default.get_config()
  config.update(optimizer="adamw", b2=BETA2, weight_decay=WD, initial_batch_size=16)
  params = {"kernel": tree(0)["w"], "bias": tree(0)["b"]}
  assert coupling_states(optimizers.create_optimizer(config).init(params)) == []
  for optimizer in ("adamw", "lamb"):
    config.update(optimizer=optimizer, adam_coupling="beta2, weight_decay")
    (coupling,) = coupling_states(optimizers.create_optimizer(config).init(params))
    assert float(coupling.coupled_batch_size) == 16  # B_0: the config's initial batch size
    hyper = coupling.inner_state.hyperparams
    assert float(hyper["b2"]) == pytest.approx(BETA2) and "mask" not in hyper  # mask: static
  config.update(optimizer="sgd", adam_coupling="beta2")
  with pytest.raises(ValueError, match=r"it needs optimizer 'adamw' or 'lamb', not 'sgd'"):
    optimizers.create_optimizer(config)
  config.update(optimizer="adamw", adam_coupling="beta1")
  with pytest.raises(ValueError, match=r"adam_coupling='beta1' names \['beta1'\]"):
    optimizers.create_optimizer(config)


@pytest.mark.parametrize("optimizer", [optax.adam, optax.adamw, optax.lamb])
def test_the_sqrt_rule_for_adam_is_adam_at_the_sqrt_scaled_rate(optimizer):
  # Malladi et al. 2022's square-root scaling rule: at 4 B0, Adam's rate times sqrt(4) = 2.
  chained = optax.chain(optimizer(LR), simigrad_jax.scale_by_lr_factor())
  state = simigrad_jax.set_lr_factor(chained.init(tree(0)), simigrad_jax.lr_factor(4 * B0, B0))
  scaled = optimizer(2 * LR)
  scaled_state = scaled.init(tree(0))
  for step in range(3):
    grads = tree(step + 1)
    updates, state = chained.update(grads, state, tree(0))
    expected, scaled_state = scaled.update(grads, scaled_state, tree(0))
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6), updates, expected)
