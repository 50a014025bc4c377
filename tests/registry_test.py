"""Controllers by name: the registry the trainer and the train configs use."""

import ast
import pathlib

import pytest

import simigrad_jax


def test_simigrad_by_name_is_the_reference_controller():
  controller = simigrad_jax.make_controller(
    "simigrad", initial_batch_size=128, similarity_target=0.1
  )
  assert isinstance(controller, simigrad_jax.Controller)
  assert controller.update(0.0) == 140  # below target: max(B + 1, int(B * 1.1))


def test_fixed_never_moves_and_still_counts():
  controller = simigrad_jax.make_controller("fixed", initial_batch_size=96)
  assert [controller.update(s) for s in (-1.0, 0.0, 0.9, float("nan"))] == [96] * 4
  assert controller.last_decision == "nonfinite" and controller.nonfinite_count == 1


def test_unknown_name_and_duplicate_registration_are_refused():
  with pytest.raises(
    ValueError, match=r"unknown controller 'adaptive'; choose one of \(.*'fixed'.*'simigrad'"
  ):
    simigrad_jax.make_controller("adaptive", initial_batch_size=8)
  with pytest.raises(ValueError, match="'fixed' is already registered"):
    simigrad_jax.register_controller("fixed", simigrad_jax.Controller)
  # Refused when registered, not at the first make_controller, and nothing is registered.
  before = simigrad_jax.controller_names()
  for name in ("", "  ", None, 3):
    with pytest.raises(ValueError, match=rf"the name must be a non-empty string, got {name!r}"):
      simigrad_jax.register_controller(name, simigrad_jax.Controller)  # type: ignore[arg-type]
  with pytest.raises(ValueError, match=r"the factory must be a controller class .*got 'simigrad'"):
    simigrad_jax.register_controller("mine", "simigrad")  # type: ignore[arg-type]
  assert simigrad_jax.controller_names() == before


def test_the_built_in_names_are_one_table_and_importing_a_module_registers_nothing():
  """The table in simigrad_jax/registry.py names every built-in controller; no module of the
  package calls register_controller when it is imported."""
  from simigrad_jax import registry

  assert set(registry.BUILT_IN_CONTROLLERS) == set(simigrad_jax.controller_names())
  with pytest.raises(TypeError):
    registry.BUILT_IN_CONTROLLERS["mine"] = simigrad_jax.Controller  # type: ignore[index]
  package = pathlib.Path(simigrad_jax.__file__).parent
  calls = [
    f"{path.relative_to(package)}:{node.lineno}"
    for path in sorted(package.rglob("*.py"))
    for statement in ast.parse(path.read_text()).body
    if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    for node in ast.walk(statement)
    if isinstance(node, ast.Call) and "register_controller" in ast.unparse(node.func)
  ]
  assert not calls, f"registrations at import: {calls}"


def test_a_users_controller_registers_beside_the_built_in_ones(monkeypatch):
  from simigrad_jax import registry

  monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
  simigrad_jax.register_controller("constant", registry.BUILT_IN_CONTROLLERS["fixed"])
  assert "constant" in simigrad_jax.controller_names()
  assert "constant" not in registry.BUILT_IN_CONTROLLERS
  assert registry.controller_options("constant") == registry.controller_options("fixed")
  assert simigrad_jax.make_controller("constant", initial_batch_size=24).update(0.5) == 24


def test_misspelt_and_foreign_options_are_refused_with_the_valid_names():
  with pytest.raises(
    TypeError,
    match=r"make_controller\('simigrad'\) got unknown option\(s\) "
    r"'similarty_target' \(did you mean 'similarity_target'\?\); 'simigrad' takes "
    r"\[.*'similarity_target'.*\]",
  ):
    simigrad_jax.make_controller("simigrad", initial_batch_size=8, similarty_target=0.1)
  # The factories that pass options on: the class's options, less those the factory sets.
  with pytest.raises(TypeError, match=r"unknown option\(s\) 'enable_adjust'; 'fixed' takes"):
    simigrad_jax.make_controller("fixed", initial_batch_size=8, enable_adjust=True)
  with pytest.raises(TypeError, match=r"'multiple'; 'geometric' takes \[.*'final_batch_size'"):
    simigrad_jax.make_controller(
      "geometric", initial_batch_size=8, final_batch_size=64, ramp_epochs=1.0, multiple=2.0
    )
  assert "shape" not in simigrad_jax.registry.controller_options("linear")
  assert "shape" in simigrad_jax.registry.controller_options("decreasing")
  assert "final_batch_size" in simigrad_jax.registry.controller_options("linear")
  assert "enable_adjust" not in simigrad_jax.registry.controller_options("fixed")
  assert "similarity_target" in simigrad_jax.registry.controller_options("fixed")
  with pytest.raises(ValueError, match="unknown controller 'adaptive'"):
    simigrad_jax.registry.controller_options("adaptive")


# ----------------------------------------------------- every registered controller

import json  # noqa: E402
import math  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

# One configuration per registered name, all starting at 16 within [8, 64].
OPTIONS = {
  "simigrad": dict(
    initial_batch_size=16,
    similarity_target=0.3,
    batch_size_lower_bound=8,
    batch_size_upper_bound=64,
  ),
  "fixed": dict(initial_batch_size=16),
  "linear": dict(initial_batch_size=16, final_batch_size=64, ramp_epochs=1.5),
  "geometric": dict(
    initial_batch_size=16, final_batch_size=64, ramp_epochs=1.5, interval_epochs=0.5
  ),
  "decreasing": dict(initial_batch_size=16, final_batch_size=8, ramp_epochs=1.0),
  "loss_plateau": dict(
    initial_batch_size=16, factor=2.0, patience=1, threshold=0.5, batch_size_upper_bound=64
  ),
  "gns": dict(
    initial_batch_size=16,
    multiple=0.5,
    ema_decay=0.5,
    batch_size_lower_bound=8,
    batch_size_upper_bound=64,
  ),
  "allowance": dict(
    initial_batch_size=16, token_allowance=1.5, ema_decay=0.5, batch_size_upper_bound=64
  ),
  "step_schedule": dict(thresholds="0:16,40:32,150:64"),
  "linear_ramp": dict(initial_batch_size=16, final_batch_size=64, increment=16, ramp=300),
  "doubling_warmup": dict(initial_batch_size=16, doubling_points="50,300"),
  "seesaw": dict(initial_batch_size=16, halving_points="50,300"),
}
STATS_KEYS = (
  "loss",
  "norm_a",
  "norm_b",
  "norm_mean",
  "batch_size",
  "examples_seen",
  "epochs",
  "epoch_end",
  "grads_finite",
)


def test_every_name_has_options_here():
  assert (
    set(OPTIONS)
    == set(simigrad_jax.controller_names())
    == {
      "simigrad",
      "fixed",
      "linear",
      "geometric",
      "decreasing",
      "loss_plateau",
      "gns",
      "allowance",
      "step_schedule",
      "linear_ramp",
      "doubling_warmup",
      "seesaw",
    }
  )


def fake_stats(step, batch_size, rng):
  """Plausible trainer stats for one step (epochs of 100 examples)."""
  na, nb = rng.uniform(0.5, 1.5, size=2)
  return {
    "loss": float(2.0 / (1 + step) + rng.uniform(0, 0.2)),
    "norm_a": float(na),
    "norm_b": float(nb),
    "norm_mean": float(rng.uniform(0.3, 1.0) * min(na, nb)),
    "batch_size": batch_size,
    "examples_seen": step * batch_size,
    "epochs": step * batch_size / 100,
    "epoch_end": step % 5 == 4,
    "grads_finite": True,
  }


def drive(controller, steps, seed=0, start=0):
  rng = np.random.default_rng(seed)
  out = []
  for step in range(start + steps):
    stats = fake_stats(step, controller.batch_size, rng)
    similarity = float(rng.uniform(-0.2, 0.6))
    if step < start:
      continue
    out.append((controller.update(similarity, stats=stats), controller.last_decision))
  return out


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_interface(name):
  c = simigrad_jax.make_controller(name, **OPTIONS[name])
  assert c.batch_size == c.initial_batch_size == 16
  for key in ("batch_size_lower_bound", "batch_size_upper_bound", "similarity_target"):
    assert key in c.config
  assert (c.config["similarity_target"] is None) == (name not in ("simigrad", "fixed"))
  assert c.last_decision is None
  sizes = drive(c, 30)
  lower = c.config["batch_size_lower_bound"] or 1
  upper = c.config["batch_size_upper_bound"] or math.inf
  assert all(type(b) is int and lower <= b <= upper for b, _ in sizes)
  assert all(isinstance(d, str) for _, d in sizes)
  if name != "fixed":
    assert len({b for b, _ in sizes}) > 1, sizes  # these settings move the size
  state = c.state_dict()
  assert json.loads(json.dumps(state)) == state  # plain JSON
  c.set_batch_size(lower)
  assert c.batch_size == lower
  with pytest.raises(ValueError, match="batch_size must"):
    c.set_batch_size(0)


# The SimiGrad controller reads only the similarity (the trainer sends NaN for a non-finite step).
NONFINITE_CASES = [
  (name, bad)
  for name in sorted(OPTIONS)
  for bad in ({"similarity": math.nan}, {"similarity": math.inf}, {"grads_finite": False})
  if not (name in ("simigrad", "fixed") and "grads_finite" in bad)
]


@pytest.mark.parametrize("name, bad", NONFINITE_CASES)
def test_nonfinite_holds_and_counts(name, bad):
  c = simigrad_jax.make_controller(name, **OPTIONS[name])
  drive(c, 7)
  before, count = c.batch_size, c.nonfinite_count
  stats = fake_stats(7, c.batch_size, np.random.default_rng(1))
  stats["grads_finite"] = bad.get("grads_finite", True)
  assert c.update(bad.get("similarity", 0.1), stats=stats) == before
  if stats["grads_finite"] and math.isnan(bad["similarity"]):
    # No similarity (a half whose gradient is zero) from finite gradients: held, not counted.
    assert c.last_decision == "unmeasured" and c.nonfinite_count == count
  else:
    assert c.last_decision == "nonfinite" and c.nonfinite_count == count + 1


NOT_SIMILARITIES = [
  ("0.5", r"got '0\.5' \(str\)"),
  (2.0, r"in \[-1, 1\].*got 2\.0"),
  (-1.5, r"in \[-1, 1\].*got -1\.5"),
  (None, r"got None \(NoneType\)"),
  (np.full(3, 0.1), r"got an array of shape \(3,\)"),
  (True, r"got True \(bool\)"),
]


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("bad, says", NOT_SIMILARITIES)
def test_update_refuses_what_is_not_a_similarity_and_changes_nothing(name, bad, says):
  c = simigrad_jax.make_controller(name, **OPTIONS[name])
  drive(c, 3)
  before = c.state_dict()
  stats = fake_stats(3, c.batch_size, np.random.default_rng(1))
  with pytest.raises(ValueError, match=r"update\(similarity\) takes .*" + says):
    c.update(bad, stats=stats)
  with pytest.raises(ValueError, match="a mapping of names to values .* got list"):
    c.update(0.1, stats=[stats])
  assert c.state_dict() == before
  # A JAX or NumPy scalar, and a cosine a rounding error above 1, are similarities.
  c.update(np.float32(0.1), stats=stats)
  c.update(jax.numpy.float32(1.0000005), stats=stats)
  assert c.last_similarity == 1.0 and c.step == before["step"] + 2


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_state_round_trip_resumes_exactly(name):
  whole = simigrad_jax.make_controller(name, **OPTIONS[name])
  expected = drive(whole, 40)
  first = simigrad_jax.make_controller(name, **OPTIONS[name])
  drive(first, 17)
  resumed = simigrad_jax.make_controller(name, **OPTIONS[name])
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  assert drive(resumed, 23, start=17) == expected[17:]
  assert resumed.state_dict() == whole.state_dict()


# ------------------------------------------------------------ in the real Trainer


class _TinyMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.tanh(nn.Dense(8)(x)))


def _loss(params, model_state, batch, weights, rng):
  del weights, rng
  logits = _TinyMLP().apply({"params": params}, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), model_state


def _train(workdir, name, num_steps, cache_dir):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(120, 5)).astype(np.float32)
  y = (x[:, :3] + rng.normal(size=(120, 3))).argmax(-1).astype(np.int32)
  params = _TinyMLP().init(jax.random.key(0), x[:1])["params"]
  optimizer = optax.chain(
    simigrad_jax.transform("batch"), optax.sgd(0.3, momentum=0.9), simigrad_jax.scale_by_lr_factor()
  )
  with simigrad_jax.compile.persistent_cache_settings():  # the Trainer's cache is process-wide
    trainer = simigrad_jax.Trainer(
      loss_fn=_loss,
      params=params,
      optimizer=optimizer,
      source=simigrad_jax.ArraySource({"x": x, "y": y}),
      controller=simigrad_jax.make_controller(name, **OPTIONS[name]),
      workdir=workdir,
      config=simigrad_jax.TrainerConfig(
        max_micro_batch_size=8,
        seed=2,
        progress=False,
        tensorboard=False,
        compile=simigrad_jax.CompileConfig(cache_dir=cache_dir),
      ),
    )
    with trainer:
      trainer.train(num_steps=num_steps)
  return [
    (r["batch_size"], r["next_batch_size"], r["decision"])
    for r in simigrad_jax.read_metrics(pathlib.Path(workdir) / "metrics.jsonl")
    if "batch_size" in r
  ]


@pytest.mark.parametrize("name", ["gns", "allowance", "loss_plateau", "geometric"])
def test_trainer_runs_and_resumes_each_controller_exactly(name, tmp_path, devices):
  del devices
  cache = tmp_path / "cache"
  straight = _train(tmp_path / "straight", name, 20, cache)
  assert len(straight) == 20
  assert len({b for b, _, _ in straight}) > 1, straight  # the size moved in the real loop
  assert {d for _, _, d in straight} <= {"grow", "shrink", "hold", "clamped", "warmup"}
  _train(tmp_path / "resumed", name, 9, cache)
  assert _train(tmp_path / "resumed", name, 20, cache) == straight


# The options train/train.py gives every registered controller, plus each one's own.
OWN_OPTIONS = {
  "simigrad": dict(similarity_target=0.1),
  "fixed": dict(),
  "linear": dict(final_batch_size=256, ramp_epochs=4.0),
  "geometric": dict(final_batch_size=256, ramp_epochs=4.0, interval_epochs=1.0),
  "decreasing": dict(final_batch_size=8, ramp_epochs=4.0),
  "loss_plateau": dict(factor=2.0),
  "gns": dict(multiple=0.5),
  "allowance": dict(token_allowance=1.1),
  "step_schedule": dict(thresholds="0:32,100:64,400:256"),
  "linear_ramp": dict(final_batch_size=256, increment=32, ramp="1k"),
  "doubling_warmup": dict(doubling_points="100,400,900"),
  "seesaw": dict(halving_points="100,400,900"),
}


@pytest.mark.parametrize("name", sorted(OWN_OPTIONS))
@pytest.mark.parametrize("upper", [None, 128])
def test_every_name_takes_the_train_configs_bounds(name, upper):
  assert set(OWN_OPTIONS) == set(simigrad_jax.controller_names())
  c = simigrad_jax.make_controller(
    name,
    initial_batch_size=32,
    batch_size_lower_bound=8,
    batch_size_upper_bound=upper,
    **OWN_OPTIONS[name],
  )
  lower, top = c.config["batch_size_lower_bound"], c.config["batch_size_upper_bound"]
  assert lower is not None and 8 <= lower <= 32
  assert top is None or 32 <= top <= (upper or math.inf)
  sizes = [b for b, _ in drive(c, 60)]
  assert all(lower <= b <= (top or math.inf) for b in sizes)
  if name in ("linear", "geometric") and upper == 128:
    assert max(sizes) == 128  # the schedule is clamped to the upper bound


@pytest.mark.parametrize(
  "name",
  ["linear", "geometric", "decreasing", "loss_plateau", "gns", "step_schedule", "seesaw"],
)
def test_missing_stats_change_nothing(name):
  c = simigrad_jax.make_controller(name, **OPTIONS[name])
  drive(c, 5)
  before = c.state_dict()
  with pytest.raises(ValueError, match=r"controller needs update\(similarity, stats=...\)"):
    c.update(0.1)
  with pytest.raises(ValueError, match="got \\['unrelated'\\]"):
    c.update(0.1, stats={"unrelated": 1})
  assert c.state_dict() == before
