"""benchmarks/step_cost/reduction.py: a tiny run, its JSON schema and the ring-model byte ratios."""

import json

import pytest

from benchmarks.step_cost import hlo_collectives


@pytest.fixture(scope="module")
def reduction():
  """The benchmark script's module."""
  from benchmarks.step_cost import reduction as module  # pylint: disable=import-outside-toplevel

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
  found = hlo_collectives.parse_collectives(_SYNTHETIC_HLO, num_devices=8)
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
  assert set(written["variants"]) == {
    "pmean",
    "transform",
    "scatter",
    "stacked",
    "transform_shard_map",
  }
  for name, variant in written["variants"].items():
    assert variant["seconds"] > 0, name
    assert variant["collective_bytes"] > 0, name
    assert variant["bytes_accessed"] > 0 and variant["temp_bytes"] >= 0, name
    assert variant["seconds"] == pytest.approx(returned["variants"][name]["seconds"])
    # Every variant returns the same mean gradient.
    assert variant["max_abs_diff_vs_pmean"] < 1e-5, name

  grad_bytes = 4 * written["params"]
  ring = 2 * 7 / 8 * grad_bytes
  bytes_of = {name: v["collective_bytes"] for name, v in written["variants"].items()}
  assert bytes_of["pmean"] == pytest.approx(ring, rel=1e-6)
  for name, ratio in (
    ("transform", 1.0),
    ("transform_shard_map", 1.0),
    ("scatter", 1.5),
    ("stacked", 2.0),
  ):
    assert bytes_of[name] / bytes_of["pmean"] == pytest.approx(ratio, rel=0.02), name
  kinds = {c["kind"] for c in written["variants"]["transform"]["collectives"]}
  assert kinds == {"reduce-scatter", "all-to-all", "all-gather", "all-reduce"}
  goals = written["goals"]
  assert set(goals) == {"transform.bytes_ratio_to_pmean", "transform.bytes_accessed_ratio_to_pmean"}
  assert goals["transform.bytes_ratio_to_pmean"]["met"]
  # (Memory traffic is checked at realistic leaf sizes below: in this tiny tree every leaf
  # is small, so the copies into the shared bucket dominate.)


# Large leaves (each its own bucket) and small ones (one shared bucket). "padded" has a large
# leaf whose size is not a multiple of 8: it is padded, which costs a copy in and out.
TREES = {
  "divisible": {"w": (256, 1024), "b": (301,), "s": ()},
  "padded": {"w": (256, 1024), "v": (300, 301), "b": (301,), "s": ()},
}


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hierarchical_transform_sends_one_all_reduce_in_the_gradient_dtype(
  reduction, devices, dtype, tree
):
  """Collective bytes equal pmean's in the gradient's own dtype; memory traffic <= 1.3x."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  import simigrad_jax  # pylint: disable=import-outside-toplevel

  shapes = TREES[tree]
  grads = {name: jnp.ones((8,) + shape, dtype) for name, shape in shapes.items()}
  tx = simigrad_jax.transform(reduction.AXIS)
  transform = jax.pmap(lambda g: tx.update(g, tx.init(g)), axis_name=reduction.AXIS)
  pmean = jax.pmap(lambda g: jax.lax.pmean(g, reduction.AXIS), axis_name=reduction.AXIS)
  measured = {}
  for name, fn in (("transform", transform), ("pmean", pmean)):
    compiled = fn.lower(grads).compile()
    collectives = hlo_collectives.parse_collectives(compiled.as_text(), len(devices))
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    measured[name] = (collectives, cost["bytes accessed"])
  # The program asks for its collectives in the gradient's dtype: bf16 gradients move bf16
  # bytes where the backend reduces bf16 (XLA:CPU widens bf16 collectives to f32, pmean's too).
  short = "bf16" if dtype == "bfloat16" else "f32"
  jaxpr = str(jax.make_jaxpr(transform)(grads))
  for op in ("reduce_scatter", "all_to_all", "all_gather"):
    lines = [line for line in jaxpr.splitlines() if f"= {op}[" in line]
    assert lines and all(f":{short}[" in line.split("=")[0] for line in lines), (op, lines)
  statistics = [c for c in measured["transform"][0] if c.payload_bytes <= 64]
  # Only the float32 statistics (four scalars) travel outside the gradient's dtype.
  assert [c.kind for c in statistics] == ["all-reduce"]
  sent = sum(c.bytes for c in measured["transform"][0] if c not in statistics)
  # The per-device sends add up to one ring all-reduce of the gradient (up to the padding).
  pmean_sent = sum(c.bytes for c in measured["pmean"][0])
  assert sent == pytest.approx(pmean_sent, rel=2e-3)
  if tree == "divisible" and dtype == "float32":
    assert measured["transform"][1] <= 1.3 * measured["pmean"][1]
