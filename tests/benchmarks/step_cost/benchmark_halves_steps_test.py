"""benchmarks/step_cost/halves_steps.py: a tiny run, its JSON layout, its ratios and its similarities."""

import json
import math

import pytest

from benchmarks.step_cost import halves_steps

ROW_NUMBERS = ("paired_time_ratio", "step_seconds", "plain_step_seconds", "temp_ratio")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """One ``--quick`` run of the MLP: (the JSON written to --out, the dict main returned)."""
  out = tmp_path_factory.mktemp("halves_steps") / "halves.json"
  returned = halves_steps.main(["--quick", "--models", "mlp", "--out", str(out)])
  return json.loads(out.read_text()), returned


def test_every_step_has_a_row_on_each_device_count(quick_run):
  written, returned = quick_run
  assert written == returned
  assert written["batch"] == halves_steps.QUICK["batch"]
  assert written["rounds"] == halves_steps.QUICK["rounds"]
  assert written["sizes"]["widths"] == list(halves_steps.QUICK["widths"])
  assert sorted(written["devices"]) == ["1", "8", "8 Explicit"]
  assert set(written["devices"]["1"]["rows"]["mlp"]) == {"two_pass", "nnx", "pmap"}
  assert set(written["devices"]["8"]["rows"]["mlp"]) == set(halves_steps.BASELINES)
  # On Explicit axes the plain jax.jit steps only.
  assert set(written["devices"]["8 Explicit"]["rows"]["mlp"]) == {"two_pass", "device_halves"}
  for key, part in written["devices"].items():
    assert part["device"]["devices_visible"] == int(key.split()[0])
    assert list(part["rows"]) == ["mlp"]


def test_ratios_are_positive_and_relative_to_the_plain_step(quick_run):
  written, _ = quick_run
  for count, part in written["devices"].items():
    for name, row in part["rows"]["mlp"].items():
      assert row["baseline"] == halves_steps.BASELINES[name]
      for key in ROW_NUMBERS:
        value = row[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (count, name, key)
      assert isinstance(row["temp_bytes"], int) and row["temp_bytes"] > 0
      assert row["temp_ratio"] == pytest.approx(row["temp_bytes"] / row["plain_temp_bytes"])


def test_every_step_measures_the_same_similarity(quick_run):
  written, _ = quick_run
  measured = {
    (count, name): row["similarity"]
    for count, part in written["devices"].items()
    for name, row in part["rows"]["mlp"].items()
  }
  reference = measured[("1", "two_pass")]
  assert -1.0 <= reference <= 1.0 and reference != 0.0
  for key, value in measured.items():
    assert value == pytest.approx(reference, abs=1e-5), key


def test_the_docs_table_has_a_row_per_device_count(quick_run):
  written, _ = quick_run
  lines = halves_steps.markdown_table(written).splitlines()
  assert len(lines) == 2 + 3
  one, eight, explicit = lines[2:]
  assert one.startswith("| 1 | MLP | ") and one.count(" - ") == 1  # no device split
  assert eight.startswith("| 8 | MLP | ") and " - " not in eight
  assert explicit.startswith("| 8, `Explicit` axes | MLP | ") and explicit.count(" - ") == 2
  ratio = written["devices"]["8"]["rows"]["mlp"]["device_halves"]["paired_time_ratio"]
  assert f"{ratio:.2f}x" in eight


@pytest.mark.parametrize(
  "argv",
  [
    ["--batch", "40"],
    ["--batch", "0"],
    ["--models", "rnn"],
    ["--widths", "32,x"],
    ["--devices", "0,x"],
  ],
)
def test_bad_settings_are_refused(argv, capsys):
  with pytest.raises(SystemExit):
    halves_steps.main(["--quick", *argv])
  assert argv[1] in capsys.readouterr().err


def test_the_device_counts_are_a_flag_and_set_the_batchs_divisor():
  args = halves_steps._parse_args(["--quick", "--devices", "1", "--batch", "6", "--out", ""])
  assert args.devices == (1,) and args.batch == 6  # 1 device: any even batch
  with pytest.raises(SystemExit):
    halves_steps._parse_args(["--quick", "--devices", "1,4", "--batch", "12", "--out", ""])


def test_a_child_saves_each_model_as_it_finishes(tmp_path, monkeypatch):
  """A run stopped in its second model (a time-out) keeps the first one's rows in the JSON."""
  out = tmp_path / "halves.json"
  halves_steps.write_json(str(out), {"devices": {"1": {"rows": {"x": 1}}}, "batch": 32})
  measured = []

  def measure(steps, rounds):
    if measured:
      raise TimeoutError("stopped in the second model")
    measured.append(steps)
    return {"two_pass": {"paired_time_ratio": 1.5}}

  monkeypatch.setattr(halves_steps.common, "configure_host_devices", lambda count: None)
  monkeypatch.setattr(halves_steps, "_steps", lambda model, *rest: model)
  monkeypatch.setattr(halves_steps, "_measure", measure)
  args = halves_steps._parse_args(
    ["--quick", "--child", "8", "--part", "8 Explicit", "--models", "mlp,cnn", "--out", str(out)]
  )
  with pytest.raises(TimeoutError):
    halves_steps._child(args)
  written = json.loads(out.read_text())
  assert written["batch"] == 32 and written["devices"]["1"] == {"rows": {"x": 1}}  # kept
  assert written["devices"]["8 Explicit"]["rows"] == {
    "mlp": {"two_pass": {"paired_time_ratio": 1.5}}
  }
  assert measured == ["mlp"] and not (tmp_path / "halves.json.partial").exists()
