"""benchmarks/step_cost/sharded_memory.py: the SimiGrad steps' memory over batch sizes, and its goal."""

import json

import pytest

LAYOUTS = ("tp", "fsdp_tp")
AXES = ("auto", "explicit")
BATCH_SIZES = (32, 256)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, devices):
  """One ``--quick`` sweep of the kernel model (512 x 512) over two layouts: its JSON."""
  del devices  # 8 devices, set up by conftest
  from benchmarks.step_cost import sharded_memory  # pylint: disable=import-outside-toplevel

  out = tmp_path_factory.mktemp("sharded_memory") / "memory.json"
  sharded_memory.main(
    ["--quick", "--models", "kernel", "--layouts", ",".join(LAYOUTS), "--out", str(out)]
  )
  return json.loads(out.read_text())


def test_every_layout_axes_and_batch_size_is_compiled_and_recorded(sweep):
  expected = {
    f"kernel/{layout}/{axes}/{batch}"
    for layout in LAYOUTS
    for axes in AXES
    for batch in BATCH_SIZES
  }
  assert set(sweep["runs"]) == expected
  for key, run in sweep["runs"].items():
    temp = run["temp_bytes"]
    assert set(temp) == {"plain", "simigrad", "groups"}, key
    assert all(value > 0 for value in temp.values()), key
    for name in ("simigrad", "groups"):
      assert run["temp_ratio_to_plain"][name] == pytest.approx(temp[name] / temp["plain"]), key
    lighter = min(("simigrad", "groups"), key=temp.get)
    assert run["lighter_step"] == lighter, key
    assert run["lighter_temp_ratio_to_plain"] == run["temp_ratio_to_plain"][lighter], key
  ratios = {key: run["lighter_temp_ratio_to_plain"] for key, run in sweep["runs"].items()}
  goal = sweep["goal"]
  assert goal["worst"] == max(ratios.values()) and goal["worst_run"] in ratios
  assert goal["met"] == (goal["worst"] <= goal["limit"] == 1.05)
  assert sweep["batch_sizes"] == list(BATCH_SIZES)


def test_with_few_rows_under_auto_axes_fsdp_and_tp_take_the_halves_step(sweep):
  """XLA plans that plain step around the kernel's blocks, which the device halves cannot follow:
  they hold more than the plain step there, and the value_and_half_grads step holds less. Every
  other configuration: the device halves within 1.05x, the halves step holding a second
  gradient. At every one, one of the two is within 1.05x."""
  runs = sweep["runs"]
  few_rows = runs["kernel/fsdp_tp/auto/32"]
  assert few_rows["temp_ratio_to_plain"]["groups"] > 1.2
  assert few_rows["temp_ratio_to_plain"]["simigrad"] < 0.5
  assert few_rows["lighter_step"] == "simigrad"
  for key, run in runs.items():
    if key != "kernel/fsdp_tp/auto/32":
      assert run["temp_ratio_to_plain"]["groups"] <= 1.05, key
    if "/tp/" in key or "explicit" in key:
      assert run["temp_ratio_to_plain"]["simigrad"] > 1.4, key
  assert sweep["goal"]["met"], sweep["goal"]


def test_batch_sizes_that_leave_a_device_an_odd_number_of_rows_are_refused():
  from benchmarks.step_cost import sharded_memory  # pylint: disable=import-outside-toplevel

  with pytest.raises(SystemExit):
    sharded_memory.main(["--quick", "--batch-sizes", "32,24"])
