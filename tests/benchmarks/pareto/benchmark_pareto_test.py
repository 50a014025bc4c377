"""benchmarks/pareto/pareto.py: a tiny in-process run (JSON schema, PNG) and the Pareto analysis by hand."""

import dataclasses
import json
import math
import numbers

import numpy as np
import pytest

import simigrad_jax
from benchmarks.pareto import analysis as pareto_analysis
from benchmarks.pareto import flags as pareto_flags
from benchmarks.pareto import images as pareto_images
from benchmarks.pareto import pareto
from benchmarks.pareto import protocol as pareto_protocol
from benchmarks.pareto import report as pareto_report

TINY = [
  "--quick",
  "--epochs",
  "1",
  "--seeds",
  "0,1",
  "--fixed",
  "16,64",
  "--lr-multipliers",
  "1",
  "--targets",
  "0.3",
  "--gns",
  "0.5",
  "--schedules",
  "geometric",
  "--bounds",
  "16:128",
  "--adaptive-lr-rules",
  "sqrt",
  "--profile",
  "--profile-steps",
  "1",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """One tiny run: (the JSON written to --out, the dict main returned, the PNG path)."""
  tmp = tmp_path_factory.mktemp("pareto")
  out = tmp / "pareto.json"
  returned = pareto.main(TINY + ["--out", str(out)])
  return json.loads(out.read_text()), returned, tmp / "pareto.png"


def test_jax_cache_settings_are_put_back(tiny_run):
  import jax  # pylint: disable=import-outside-toplevel

  # The run's trainers pointed JAX's persistent cache into a temporary directory it deleted.
  directory = jax.config.jax_compilation_cache_dir
  assert directory is None or "simigrad-pareto-" not in directory


def test_json_schema(tiny_run, devices):
  written, returned, _ = tiny_run
  assert written["devices"] == len(devices) == 8
  assert written["dataset"] == "digits" and written["epochs"] == 1
  runs = written["runs"]
  # 2 fixed sizes + 1 target + 1 multiple + 1 schedule, 2 seeds each.
  assert len(runs) == 10
  assert sorted({r["controller"] for r in runs}) == ["fixed", "geometric", "gns", "simigrad"]
  for run in runs:
    for key, kind in pareto_protocol.RUN_KEYS.items():
      value = run[key]
      assert isinstance(value, kind) and not isinstance(value, bool), (key, value)
      if isinstance(value, numbers.Real):
        assert math.isfinite(value), (key, value)
    assert 0.0 <= run["test_accuracy"] <= 1.0
    assert run["seed"] in (0, 1)
    assert run["steps"] >= 1 and run["wall_seconds"] > 0
    # One epoch of the 1,257 training examples, every run.
    assert run["examples"] == written["num_train"] == 1257
    assert run["avg_batch_size"] == pytest.approx(run["examples"] / run["steps"])
    assert run["settings"]["learning_rate"] > 0
  assert json.loads(json.dumps(returned, default=str)) == written


def test_runs_are_what_they_claim(tiny_run):
  written, _, _ = tiny_run
  by = {}
  for run in written["runs"]:
    by.setdefault(run["controller"], []).append(run)
  for run in by["fixed"]:
    b = run["settings"]["initial_batch_size"]
    assert run["steps"] == math.ceil(1257 / b) and run["max_batch_size"] == b
    assert run["settings"]["learning_rate"] == pytest.approx(0.2 * math.sqrt(b / 32))
  for run in by["simigrad"] + by["gns"]:
    assert run["settings"]["batch_size_lower_bound"] == 16
    assert 16 <= run["avg_batch_size"] <= 128 and run["max_batch_size"] <= 128
    assert run["settings"]["learning_rate"] == pytest.approx(0.2)  # the base, at B_0 = 32
  for run in by["geometric"]:
    assert run["max_batch_size"] > 32  # it grew
  # Seeds differ: the two seeds of a setting do not train identically.
  fixed16 = [r for r in by["fixed"] if r["settings"]["initial_batch_size"] == 16]
  assert fixed16[0]["test_loss"] != fixed16[1]["test_loss"]
  # Learning happened: far above chance (10%) after one epoch at B=16.
  assert min(r["test_accuracy"] for r in fixed16) > 0.5


def test_groups_summary_and_profile(tiny_run):
  written, _, _ = tiny_run
  groups = written["groups"]
  assert len(groups) == 5 and all(g["seeds"] == [0, 1] for g in groups)
  for g in groups:
    members = [
      r["test_accuracy"]
      for r in written["runs"]
      if r["controller"] == g["controller"] and r["settings"] == g["settings"]
    ]
    assert g["test_accuracy_mean"] == pytest.approx(np.mean(members))
    assert g["test_accuracy_std"] == pytest.approx(np.std(members, ddof=1))
  front = written["summary"]["fixed_front"]
  assert front and all(a["test_accuracy"] > b["test_accuracy"] for a, b in zip(front, front[1:]))
  assert written["summary"]["simigrad"]["settings"] == 1
  profile = written["profile"]
  assert profile["sizes"][0] == 8 and profile["sizes"][-1] == 1024
  assert [p["epochs"] for p in profile["points"]] == [0.0, 0.25, 0.5, 0.75, 1.0]
  for point in profile["points"]:
    for b in profile["sizes"]:
      cell = point["per_size"][str(b)]
      assert cell["count"] == 1 and -1.0 <= cell["similarity_mean"] <= 1.0
  # At initialisation the gradient is clear: the similarity rises with the batch size.
  first = profile["points"][0]["per_size"]
  assert first["1024"]["similarity_mean"] > first["8"]["similarity_mean"]


def test_png_is_readable(tiny_run):
  written, _, png = tiny_run
  assert written["png"] == str(png)
  data = png.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  from matplotlib import image  # pylint: disable=import-outside-toplevel

  pixels = image.imread(str(png))
  height, width = pixels.shape[:2]
  assert width >= 1200 and height >= 400  # three panels side by side
  assert pixels[..., :3].std() > 0.05  # not blank


# ------------------------------------------------------------------ the analysis


def test_pareto_front_by_hand():
  points = [(16, 0.95), (32, 0.96), (64, 0.94), (128, 0.94), (256, 0.90), (512, 0.91)]
  assert pareto_analysis.pareto_front(points) == [(32, 0.96), (128, 0.94), (512, 0.91)]
  front = pareto_analysis.pareto_front(points)
  assert pareto_analysis.front_accuracy(front, 10) == 0.96
  assert pareto_analysis.front_accuracy(front, 40) == 0.94
  assert pareto_analysis.front_accuracy(front, 128) == 0.94
  assert pareto_analysis.front_accuracy(front, 200) == 0.91
  assert pareto_analysis.front_accuracy(front, 600) is None
  # Interpolated in log2(B): 64 is halfway between 32 and 128.
  assert pareto_analysis.interpolated_front(front, 64) == pytest.approx(0.95)
  assert pareto_analysis.interpolated_front(front, 256) == pytest.approx(0.925)
  assert (
    pareto_analysis.interpolated_front(front, 8) == 0.96
    and pareto_analysis.interpolated_front(front, 513) is None
  )


def _group(controller, accuracy, batch, label, val=None, steps=100.0, **settings):
  return {
    "controller": controller,
    "label": label,
    "test_accuracy_mean": accuracy,
    "test_accuracy_std": 0.0,
    "val_accuracy_mean": accuracy if val is None else val,
    "avg_batch_size_mean": batch,
    "avg_batch_size_std": 0.0,
    "steps_mean": steps,
    "max_batch_size": int(batch),
    "wall_seconds_mean": 1.0,
    "settings": {"lr_multiplier": 1.0, **settings},
  }


def test_selection_by_validation_and_summary_by_hand():
  groups = [
    _group("fixed", 0.95, 16, "B=16", steps=400, initial_batch_size=16),
    _group("fixed", 0.97, 32, "B=32", val=0.90, steps=200, initial_batch_size=32),
    _group("fixed", 0.96, 32, "B=32", val=0.93, steps=200, initial_batch_size=32),
    _group("fixed", 0.93, 128, "B=128", steps=50, initial_batch_size=128),
    _group("simigrad", 0.957, 90, "s=0.2", steps=70, similarity_target=0.2),
    _group("simigrad", 0.94, 60, "s=0.1", steps=105, similarity_target=0.1),
    _group("simigrad", 0.92, 300, "s=0.5", steps=20, similarity_target=0.5),
    _group("gns", 0.90, 40, "m=1", steps=150, multiple=1.0),
  ]
  best = pareto_analysis.select_fixed(groups)
  assert best[32] is groups[2]  # better validation accuracy, worse test accuracy
  assert [g["selected"] for g in groups] == [True, False, True, True, True, True, True, True]
  summary = pareto_analysis.summarize(groups)
  assert summary["fixed_front"] == [
    {"avg_batch_size": 32, "test_accuracy": 0.96},
    {"avg_batch_size": 128, "test_accuracy": 0.93},
  ]
  assert summary["best_fixed"]["batch_size"] == 32
  s = summary["simigrad"]
  assert (s["settings"], s["judged"], s["on_or_beyond_front"]) == (3, 2, 2)
  assert s["best_gap_points"] == pytest.approx(2.7)
  assert s["matches_best_fixed"]["label"] == "s=0.2"  # 0.957 >= 0.96 - 0.005
  assert s["matches_best_fixed"]["steps_ratio_to_best_fixed"] == pytest.approx(0.35)
  # s=0.2 at 90: the front interpolated between (32, 0.96) and (128, 0.93).
  interp = 0.96 + math.log2(90 / 32) / 2 * (0.93 - 0.96)
  assert groups[4]["gap_interp_points"] == pytest.approx(100 * (0.957 - interp))
  assert s["on_or_above_interpolated"] == 1 and groups[6]["gap_interp_points"] is None
  g = summary["gns"]
  assert g["on_or_beyond_front"] == 0 and g["matches_best_fixed"] is None
  assert g["best_gap_points"] == pytest.approx(-3.0)
  table = pareto_report.format_table(groups, summary)
  assert (
    "simigrad: 2/2 settings on or beyond the fixed front (1 beyond the largest fixed batch)"
    in table
  )
  assert "up to avg B=90.0 (s=0.2" in table and "gns: 0/1" in table


# ------------------------------------------------------------------ data and settings


def test_mnist_absent_falls_back_to_digits(tmp_path):
  assert not pareto_images.mnist_available(tmp_path)
  dataset = pareto_images.load_dataset("mnist", data_dir=tmp_path)
  assert dataset.name == "digits" and "fell back" in dataset.note
  assert pareto_images.load_dataset("auto", data_dir=tmp_path).name == "digits"
  with pytest.raises(ValueError, match="--dataset must be one of"):
    pareto_images.load_dataset("cifar10")


def test_digits_split_is_fixed_and_a_partition():
  a, b = pareto_images.load_digits(), pareto_images.load_digits()
  np.testing.assert_array_equal(a.train["x"], b.train["x"])
  sizes = [len(s["y"]) for s in (a.train, a.val, a.test)]
  assert sizes == [1257, 180, 360]
  # The three parts are a partition of the 1,797 images (by label counts and pixel sums).
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel

  everything = load_digits()
  parts = np.concatenate([a.train["y"], a.val["y"], a.test["y"]])
  np.testing.assert_array_equal(np.bincount(parts), np.bincount(everything.target))
  total = sum(float(s["x"].sum()) for s in (a.train, a.val, a.test))
  assert total == pytest.approx(everything.data.sum() / 16.0, rel=1e-6)


@pytest.mark.skipif(not pareto_images.mnist_available(), reason="MNIST files not in ../shared/data")
def test_mnist_split():
  dataset = pareto_images.load_mnist()
  assert [len(s["y"]) for s in (dataset.train, dataset.val, dataset.test)] == [4500, 500, 10000]
  assert dataset.train["x"].shape[1] == 784 and dataset.train["x"].dtype == np.float32
  assert 0.0 <= dataset.test["x"].min() and dataset.test["x"].max() <= 1.0
  assert sorted(np.unique(dataset.test["y"])) == list(range(10))


@pytest.mark.parametrize("name", pareto_protocol.LR_SCHEDULES)
def test_lr_schedules_are_positive_and_start_at_one(name):
  f = pareto_protocol.lr_schedule_fn(name, 8)
  values = [f(e) for e in np.linspace(0, 8, 33)]
  assert min(values) > 0 and max(values) <= 1.0
  if name == "warmup_cosine":  # up over the first 10%, then down
    assert values[0] == 0.02 and f(0.4) == pytest.approx(0.5) and f(0.8) == 1.0
    assert np.all(np.diff(values[4:]) <= 0)
  else:
    assert values[0] == 1.0
  if name != "constant":
    assert values[-1] <= 0.02 + 1e-12


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--bounds", "64:512"], r"bounds 64:512 must satisfy 2 <= lower <= --initial-batch-size"),
    (["--fixed", "4096"], r"fixed batch size 4096 must lie in \[1, 1257\]"),
    (["--targets", "1.5"], r"similarity target 1.5 must lie in \[-1, 1\]"),
    (["--epochs", "0"], "--epochs must be > 0"),
  ],
)
def test_bad_arguments_raise_before_training(argv, match):
  with pytest.raises(ValueError, match=match):
    pareto.main(["--quick"] + argv)


def test_adaptive_lr_variants_and_reuse(tiny_run, tmp_path):
  written, _, _ = tiny_run
  first = tmp_path / "first.json"
  first.write_text(json.dumps(written))
  again = pareto.main(
    [
      "--quick",
      "--epochs",
      "1",
      "--seeds",
      "0,1",
      "--fixed",
      "16,64",
      "--lr-multipliers",
      "1",
      "--targets",
      "0.3",
      "--gns",
      "",
      "--schedules",
      "",
      "--bounds",
      "16:128",
      "--adaptive-lr-rules",
      "sqrt,linear",
      "--reuse",
      str(first),
      "--out",
      str(tmp_path / "again.json"),
    ]
  )
  # The 4 fixed runs and the 2 sqrt-rule SimiGrad runs are taken from the first result.
  assert again["reused_runs"] == 6 and again["reused_from"] == [str(first)]
  reused = [r for r in again["runs"] if r.get("reused")]
  assert {(r["controller"], r["settings"]["lr_rule"]) for r in reused} == {
    ("fixed", "sqrt"),
    ("simigrad", "sqrt"),
  }
  fixed_then = sorted(
    (r["settings"]["initial_batch_size"], r["seed"], r["test_accuracy"])
    for r in written["runs"]
    if r["controller"] == "fixed"
  )
  fixed_now = sorted(
    (r["settings"]["initial_batch_size"], r["seed"], r["test_accuracy"])
    for r in again["runs"]
    if r["controller"] == "fixed"
  )
  assert fixed_now == fixed_then
  simigrad = [r for r in again["runs"] if r["controller"] == "simigrad"]
  assert sorted((r["settings"]["lr_rule"], r["seed"]) for r in simigrad) == [
    ("linear", 0),
    ("linear", 1),
    ("sqrt", 0),
    ("sqrt", 1),
  ]
  trained = {r["seed"]: r for r in simigrad if r["settings"]["lr_rule"] == "linear"}
  assert not any(r.get("reused") for r in trained.values())
  same_seed = {r["settings"]["lr_rule"]: r for r in simigrad if r["seed"] == 0}
  assert same_seed["linear"]["test_loss"] != same_seed["sqrt"]["test_loss"]
  groups = [g for g in again["groups"] if g["controller"] == "simigrad"]
  assert len(groups) == 2 and sum(g["selected"] for g in groups) == 1
  chosen = max(groups, key=lambda g: (g["val_accuracy_mean"], -g["val_loss_mean"]))
  assert chosen["selected"]
  assert again["summary"]["simigrad"]["settings"] == 1  # judged on the selected variant only


def test_reuse_refuses_a_different_experiment_and_matches_exactly(tiny_run, tmp_path):
  written, _, _ = tiny_run
  first = tmp_path / "first.json"
  first.write_text(json.dumps({**written, "epochs": 2}))
  with pytest.raises(ValueError, match="epochs is 2, this run has 1"):
    pareto.main(TINY + ["--reuse", str(first)])
  first.write_text(json.dumps(written))
  expected = {k: written[k] for k in pareto_protocol.REUSE_KEYS}
  cache = pareto_protocol.RunCache([str(first)], expected)
  spec = pareto_protocol.RunSpec("fixed", (("initial_batch_size", 64),), 0.2 * math.sqrt(2), 1.0, 1)
  assert cache.lookup(spec)["settings"]["initial_batch_size"] == 64
  for other in (
    dataclasses.replace(spec, seed=2),
    dataclasses.replace(spec, lr=0.3),
    dataclasses.replace(spec, lr_rule="linear"),
    dataclasses.replace(spec, options=(("initial_batch_size", 32),)),
  ):
    assert cache.lookup(other) is None
  assert cache.reused == 1
  # A run with an option the spec lacks is another setting, even listed first.
  matched = cache.lookup(spec)
  path, run = next(
    (p, r)
    for p, r in cache.runs
    if (r["controller"], r["seed"], r["settings"]) == ("fixed", 1, matched["settings"])
  )
  damped = {**run, "settings": {**run["settings"], "dead_band": 0.1}}
  cache.runs.insert(0, (path, damped))
  assert "dead_band" not in cache.lookup(spec)["settings"]


def test_simigrad_option_variants_are_separate_settings():
  args = pareto_flags.parse_args(
    [
      "--quick",
      "--targets",
      "0.3",
      "--bounds",
      "16:128",
      "--gns",
      "",
      "--schedules",
      "",
      "--seeds",
      "0",
      "--simigrad-options",
      '[{}, {"smooth_factor": 0.5}, {"one_step_late": 1}]',
    ]
  )
  specs = pareto_protocol.adaptive_specs(args, args.grid, [(0.2, 1.0, "sqrt")], num_train=1257)
  assert [s.label() for s in specs] == [
    "s=0.3 [16,128]",
    "s=0.3 smooth_factor=0.5 [16,128]",
    "s=0.3 one_step_late=1 [16,128]",
  ]
  assert specs[1].settings_dict()["smooth_factor"] == 0.5
  assert "smooth_factor" not in specs[0].settings_dict()
  # Each variant is a controller the registry builds; one_step_late wraps it.
  plain, smooth, late = (pareto_protocol.run_controller(spec) for spec in specs)
  assert smooth.config["smooth_factor"] == 0.5
  assert isinstance(late, simigrad_jax.controllers.OneStepLateController)
  assert late.config == {**plain.config, "one_step_late": True}
  for bad in (
    '{"smooth_factor": 0.5}',
    '[{"similarity_target": 0.1}]',
    '[{"verbose": true}]',
    "[{",
  ):
    with pytest.raises(SystemExit):
      pareto_flags.parse_args(["--simigrad-options", bad])


def test_keep_reused_adds_runs_to_an_earlier_result(tiny_run, tmp_path):
  written, _, _ = tiny_run
  first = tmp_path / "first.json"
  first.write_text(json.dumps(written))
  with pytest.raises(ValueError, match="--keep-reused needs --reuse"):
    pareto.main(TINY + ["--keep-reused"])
  added = pareto.main(
    [
      "--quick",
      "--epochs",
      "1",
      "--seeds",
      "0",
      "--fixed",
      "16,64",
      "--lr-multipliers",
      "1",
      "--targets",
      "0.3",
      "--gns",
      "",
      "--schedules",
      "",
      "--bounds",
      "16:128",
      "--adaptive-lr-rules",
      "sqrt",
      "--simigrad-options",
      '[{"ema_decay": 0.9}]',
      "--reuse",
      str(first),
      "--keep-reused",
      "--out",
      str(tmp_path / "added.json"),
    ]
  )
  # The one new run is trained; all 10 earlier runs are kept, each once.
  assert len(added["runs"]) == 11 and added["reused_runs"] == 10
  new = [r for r in added["runs"] if not r.get("reused")]
  assert [(r["controller"], r["settings"]["ema_decay"]) for r in new] == [("simigrad", 0.9)]
  assert all(r["reused_from"] == str(first) for r in added["runs"] if r.get("reused"))
  # Summarised per variant: the plain rule and the model rule apart.
  assert added["summary"]["simigrad"]["settings"] == 1
  assert added["summary"]["simigrad ema_decay=0.9"]["settings"] == 1
  assert {"gns", "geometric"} <= set(added["summary"])
  tables = pareto_report.markdown_tables(added)
  assert "| simigrad ema_decay=0.9 | target 0.3, [16, 128] |" in tables


def test_variant_names():
  plain = _group("simigrad", 0.9, 60, "s=0.1", similarity_target=0.1, learning_rate=0.1)
  model = _group("simigrad", 0.9, 60, "s=0.1", similarity_target=0.1, ema_decay=0.9)
  assert pareto_analysis.variant(plain) == "simigrad"
  assert pareto_analysis.variant(model) == "simigrad ema_decay=0.9"
  assert pareto_analysis.variant(_group("gns", 0.9, 60, "m=1", multiple=1.0)) == "gns"
  summary = {
    "fixed_front": [],
    "best_fixed": {},
    "tolerance_points": 0.5,
    "gns": {},
    "simigrad ema_decay=0.9": {},
    "simigrad": {},
    "geometric": {},
  }
  assert pareto_analysis.variant_names(summary) == [
    "simigrad",
    "simigrad ema_decay=0.9",
    "gns",
    "geometric",
  ]
