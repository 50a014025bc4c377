"""benchmarks/reduction.py: a tiny run, its JSON schema and the ring-model byte ratios."""

import json

import pytest


@pytest.fixture(scope="module")
def reduction():
  """The benchmark script's module."""
  from benchmarks import reduction as module  # pylint: disable=import-outside-toplevel
  return module


def test_full_size_tree_is_resnet18_for_cifar(reduction):
  assert reduction.count_params(reduction.resnet18_shapes(64)) == 11_173_962
  assert reduction.width_for_params(reduction.RESNET18_CIFAR_PARAMS) == 64


_SYNTHETIC_HLO = """\
HloModule m, num_partitions=8

%wrapped_reduce_scatter_computation (param_0.1: f32[64]) -> f32[16] {
  %param_0.1 = f32[64]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[16]{0} reduce-scatter(%param_0.1), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (p0: f32[100], p1: bf16[8,4]) -> f32[] {
  %p0 = f32[100]{0} parameter(0)
  %p1 = bf16[8,4]{1,0} parameter(1)
  %ars = (f32[100]{0}, bf16[8,4]{1,0}) all-reduce-start(%p0, %p1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ard = (f32[100]{0}, bf16[8,4]{1,0}) all-reduce-done(%ars)
  %ags = (f32[25]{0}, f32[100]{0}) all-gather-start(%unknown), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %agd = f32[100]{0} all-gather-done(%ags)
  %rs-start = ((f32[64]{0}), f32[16]{0}) async-start(%x), calls=%wrapped_reduce_scatter_computation
  %cp = f32[10]{0} collective-permute(%p0s), source_target_pairs={{0,1},{1,0}}
  %f = f32[] fusion(%all-reduce.1), kind=kLoop, calls=%fused
  ROOT %ar2 = f32[6]{0} all-reduce(f32[6]{0} %y), replica_groups={}, to_apply=%add
}
"""


def test_parser_handles_async_tuple_and_iota_forms(reduction):
  found = reduction.parse_collectives(_SYNTHETIC_HLO, num_devices=8)
  summary = [(c.kind, c.group_size, c.payload_bytes, c.bytes) for c in found]
  assert summary == [
      ("reduce-scatter", 4, 256, pytest.approx(192.0)),  # inside the async wrapper, once
      ("all-reduce", 8, 400 + 64, pytest.approx(2 * 7 / 8 * 464)),  # tuple, -start counted once
      ("all-gather", 4, 400, pytest.approx(300.0)),  # output of the (in, out) start tuple
      ("collective-permute", 8, 40, pytest.approx(40.0)),
      ("all-reduce", 8, 24, pytest.approx(2 * 7 / 8 * 24)),  # old-style operand shapes
  ]


def test_tiny_run_writes_schema_and_ring_model_ratios(reduction, tmp_path, devices):
  out = tmp_path / "reduction.json"
  returned = reduction.main(["--params", "20000", "--repeats", "2", "--out", str(out)])
  written = json.loads(out.read_text())

  assert written["devices"] == len(devices) == 8
  assert isinstance(written["params"], int)
  assert 15_000 <= written["params"] <= 30_000
  assert set(written["variants"]) == {"pmean", "transform", "stacked", "transform_shard_map"}
  for name, variant in written["variants"].items():
    assert variant["seconds"] > 0, name
    assert variant["collective_bytes"] > 0, name
    assert variant["seconds"] == pytest.approx(returned["variants"][name]["seconds"])
    # Every variant returns the same mean gradient.
    assert variant["max_abs_diff_vs_pmean"] < 1e-5, name

  grad_bytes = 4 * written["params"]
  ring = 2 * 7 / 8 * grad_bytes
  bytes_of = {name: v["collective_bytes"] for name, v in written["variants"].items()}
  assert bytes_of["pmean"] == pytest.approx(ring, rel=1e-6)
  for name, ratio in (("transform", 1.5), ("transform_shard_map", 1.5), ("stacked", 2.0)):
    assert bytes_of[name] / bytes_of["pmean"] == pytest.approx(ratio, rel=0.02), name
  kinds = {c["kind"] for c in written["variants"]["transform"]["collectives"]}
  assert kinds == {"reduce-scatter", "all-gather", "all-reduce"}
