"""benchmarks/lm/verdict_lm.py, frontier.py, wsd.py: the LM verdict's analysis, order, runs and resume."""

import json
import math
import pathlib
import re
from unittest import mock

import numpy as np
import pytest

from benchmarks import common
from benchmarks.lm import frontier
from benchmarks.lm import protocol as P
from benchmarks.lm import verdict_lm
from benchmarks.lm import verdict_plot
from benchmarks.lm import verdict_report
from benchmarks.lm.run_store import RunStore

ROOT = pathlib.Path(__file__).resolve().parents[3]
SHARES = P.BUDGET_SHARES


def record(method, multiplier, seed, k, loss, steps, tokens=None):
  return {
    "task": "toy", "method": method, "lr_multiplier": multiplier, "seed": seed,
    "budget_index": k, "tokens": tokens if tokens is not None else round(SHARES[k] * 1000),
    "steps": steps, "final_val_loss": loss, "role": "tuning" if seed == 0 else "evaluation",
    "wall_seconds": 1.0,
  }  # fmt: skip


def frontier_records(method, multiplier, seed, losses, batch):
  """A frontier of ``losses`` by budget, at a constant average ``batch`` (tokens / steps)."""
  return [
    record(method, multiplier, seed, k, loss, round(SHARES[k] * 1000) / batch)
    for k, loss in enumerate(losses)
  ]


def test_the_learning_rate_grid_widens_past_an_edge_and_stops_inside():
  assert frontier.lr_grid({}) == ([2.0, 4.0, 8.0], None, False)
  assert frontier.lr_grid({2.0: 1.0, 4.0: 1.1, 8.0: 1.2}) == ([1.0], None, False)
  low = {0.5: 0.7, 1.0: 0.8, 2.0: 1.0, 4.0: 1.1, 8.0: 1.2}
  assert frontier.lr_grid(low) == ([], 0.5, False)  # widened twice, still at the edge: said
  assert frontier.lr_grid({**low, 0.5: 0.9}) == ([], 1.0, True)


def test_the_constant_sizes_widen_while_a_target_budgets_best_is_at_an_edge():
  def losses(best):  # the least loss at the size `best` at every budget
    return {b: [abs(math.log2(b / best))] * len(SHARES) for b in (2, 4, 8, 16, 32, 64, 128, 256)}

  assert frontier.size_grid({8: [1.0] * 5}) == ([16, 32, 64], [8, 16, 32, 64], False)
  first = {b: v for b, v in losses(8).items() if b in P.CONSTANT_SIZES}
  assert frontier.size_grid(first)[:2] == ([4], [4, 8, 16, 32, 64])  # 8 is the smallest: 4 joins
  assert frontier.size_grid(losses(8)) == ([], [4, 8, 16, 32, 64], True)
  assert frontier.size_grid(losses(16)) == ([], [8, 16, 32, 64], True)
  assert frontier.size_grid(losses(256)) == ([], [8, 16, 32, 64, 128, 256], False)


def test_steps_to_a_target_interpolate_in_log_steps_and_tokens():
  points = [(100.0, 10.0, 3.0), (200.0, 20.0, 2.0), (400.0, 40.0, 1.0)]
  assert frontier.steps_to_target(points, 2.0) == (20.0, 200.0)
  steps, tokens = frontier.steps_to_target(points, 1.5)
  assert steps == pytest.approx(20 * 2**0.5) and tokens == pytest.approx(200 * 2**0.5)
  assert frontier.steps_to_target(points, 3.5) == (10.0, 100.0)  # at the first budget already
  assert frontier.steps_to_target(points, 0.5) == (math.inf, math.inf)


def test_the_bootstrap_interval_holds_the_ratio_and_widens_with_the_spread():
  ratio, lo, hi = frontier.ratio_interval([5, 5, 5, 5], [10, 10, 10, 10])
  assert (ratio, lo, hi) == (0.5, 0.5, 0.5)
  ratio, lo, hi = frontier.ratio_interval([4, 6, 5, 5, 3, 7], [10, 10, 10, 10, 10, 10])
  assert ratio == pytest.approx(0.5) and lo < 0.5 < hi and lo >= 0.3 and hi <= 0.7
  assert frontier.ratio_interval([4, math.inf], [10, 10])[2] == math.inf  # a seed never reached
  assert frontier.ratio_interval([4], [10])[1:] == (0.0, math.inf)  # one seed: no interval
  # Both means unbounded: no ratio and no interval, not an unbounded one ("more steps").
  assert all(math.isnan(x) for x in frontier.ratio_interval([4, math.inf], [math.inf, 10]))
  assert frontier.outcome(math.nan, math.nan) == frontier.NEITHER_REACHES
  assert frontier.outcome(1.2, math.inf) == "more steps"


def synthetic_store(seeds=range(1, 11)):
  """A whole protocol's records: B=16 best (tuned at x4), every method tuned at x4; the
  allowance rule at half the best constant's steps and 1.05x its tokens; the doubling warmup at
  0.8x its steps; the other methods at the constants' steps with a worse loss."""
  rng = np.random.default_rng(0)
  records = []
  base = np.array([3.0, 2.5, 2.0, 1.8, 1.78])  # the loss at each budget (tokens)

  def add(method, m, seed, losses, batch):
    records.extend(frontier_records(method, m, seed, losses, batch))

  for size in (8, 16, 32, 64):
    gap = abs(math.log2(size / 16)) * 0.05
    for m in (2.0, 4.0, 8.0):
      add(f"B={size}", m, 0, base + gap + abs(math.log2(m / 4)) * 0.02, size)
    for seed in seeds:
      add(f"B={size}", 4.0, seed, base + gap + rng.normal(0, 0.002, 5), size)
  for method in P.ramp_and_adaptive_methods():
    for m in (2.0, 4.0, 8.0):
      add(method.name, m, 0, base + abs(math.log2(m / 4)) * 0.02, 16)
    for seed in seeds:
      if method.name == "allowance@full":
        # the same losses at 1.05x the tokens in half the steps: tokens 1.05x, batch 2.1 x 16
        losses, batch, scale = base + rng.normal(0, 0.002, 5), 16 * 2.1, 1.05
        for k, loss in enumerate(losses):
          tokens = SHARES[k] * 1000 * scale
          records.append(record(method.name, 4.0, seed, k, loss, tokens / batch, tokens))
        continue
      if method.name == "doubling_warmup@peak":
        add(method.name, 4.0, seed, base + rng.normal(0, 0.002, 5), 20.0)
        continue
      add(method.name, 4.0, seed, base + 0.3 + rng.normal(0, 0.002, 5), 16)
  return records


def test_the_verdicts_from_synthetic_runs():
  results = frontier.analyse(synthetic_store(), "toy")
  assert results["b0"] == 16 and results["tuned_multipliers"]["allowance@full"] == 4.0
  assert [t["best_constant"] for t in results["targets"]] == ["B=16"] * 4
  assert len(results["targets"]) == len(P.TARGET_BUDGETS)
  [decision] = [d for d in results["decisions"] if d["target_budget_share"] == 0.5]
  assert decision["best_adaptive"] == "allowance@full"
  assert decision["best_ramp"] == "doubling_warmup@peak"
  vc = decision["adaptive_vs_constant"]
  assert vc["steps_ratio"] == pytest.approx(0.5, abs=0.02)
  assert vc["tokens_ratio"] == pytest.approx(1.05, abs=0.02)
  assert vc["steps_ratio_ci"][1] < 0.6 and vc["outcome"] == "fewer steps" and vc["seeds"] == 10
  assert decision["goal_vs_constant"]
  vr = decision["adaptive_vs_ramp"]  # the ramp: 16/20 = 0.8x the constant's steps
  assert vr["steps_ratio"] == pytest.approx(0.5 / 0.8, abs=0.03) and vr["outcome"] == "fewer steps"
  keys = {"task", "method", "against", "steps_ratio", "steps_ratio_ci", "tokens_ratio", "seeds"}
  for v in results["verdicts"]:
    assert keys <= set(v) and v["task"] == "toy" and v["against"] in ("best_constant", "best_ramp")
  never = [
    v for v in results["verdicts"] if v["method"] == "gns@full" and v["against"] == "best_ramp"
  ]
  assert [v["steps_ratio"] is None for v in never] == [False, False, True, True]  # 0.3 nats worse
  assert results["runs_needed"]["allowance@full"] == {
    "tuning_runs": 3, "evaluation_runs": 10, "total_runs": 13,
    "with_the_choice_of_ramp": None, "settled_targets": 4,
  }  # fmt: skip
  assert results["runs_needed"]["doubling_warmup@peak"]["with_the_choice_of_ramp"] == 6 * 3 + 10
  constants = results["runs_needed"]["constant sizes"]
  assert (constants["tuning_runs"], constants["evaluation_runs"]) == (4 * 3, 4 * 10)
  text = verdict_report.markdown({**results, **_status()})
  assert "| 0.5: " in text and "allowance@full" in text and "[" in text
  # Every method's row, a column per target: the goal marked, a missed target named.
  rows = {
    line.split(" | ")[0][2:]: line.split(" | ")[1:]
    for line in verdict_report.methods_table(results, "best_constant").splitlines()[2:]
  }
  assert set(rows) == {v["method"] for v in results["verdicts"]}
  half = [t["budget_share"] for t in results["targets"]].index(0.5)
  assert (
    re.match(r"0\.\d\dx \[0\.\d\d, 0\.\d\d\], tokens", rows["allowance@full"][half])
    and "(goal)" in rows["allowance@full"][half]
  )
  assert "(goal)" not in rows["doubling_warmup@peak"][half]  # a ramp at 0.8x
  ramp_rows = {
    line.split(" | ")[0][2:]: line.split(" | ")[1:]
    for line in verdict_report.methods_table(results, "best_ramp").splitlines()[2:]
  }
  assert "doubling_warmup@peak" not in ramp_rows  # only adaptive rules meet the best ramp
  assert [c.startswith("never (") for c in ramp_rows["gns@full"]] == [False, False, True, True]


def test_the_plot_draws_each_methods_mean_frontier_over_its_whole_frontiers(tmp_path):
  store = synthetic_store()
  # Seed 10 of the allowance rule stopped after its first two budgets.
  store = [
    r
    for r in store
    if not (r["method"] == "allowance@full" and r["seed"] == 10 and r["budget_index"] >= 2)
  ]
  results = {**frontier.analyse(store, "toy"), **_status(), "runs": store}  # as TaskRunner writes
  frontiers = verdict_plot.mean_frontiers(results)
  assert set(frontiers) == set(results["evaluation_seeds"])  # every method with a seed
  seeds = results["evaluation_seeds"]["B=16"]
  runs = [
    r
    for r in results["runs"]
    if r["method"] == "B=16" and r["role"] == "evaluation" and r["budget_index"] == 3
  ]
  assert len(runs) == len(seeds) == 10
  want = [np.mean([r[k] for r in runs]) for k in ("steps", "tokens", "final_val_loss")]
  np.testing.assert_allclose(frontiers["B=16"][3], want)
  assert frontiers["B=16"].shape == (len(SHARES), 3)
  # A seed whose frontier stopped part way counts for no budget: every point is over seeds 1-9.
  assert results["evaluation_seeds"]["allowance@full"] == list(range(1, 10))
  last = [
    r["final_val_loss"]
    for r in store
    if r["method"] == "allowance@full" and r["role"] == "evaluation" and r["budget_index"] == 4
  ]
  assert len(last) == 9 and frontiers["allowance@full"][4][2] == pytest.approx(np.mean(last))
  png = verdict_plot.plot(results, tmp_path / "lm_toy.png")
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _status():
  return {
    "task": "toy", "frontiers_finished": 1, "frontiers_pending": 0, "train_seconds": 3600.0,
    "evaluation_seeds_planned": list(P.EVALUATION_SEEDS),
  }  # fmt: skip


def test_a_partial_store_gives_wide_verdicts_and_none_before_evaluation():
  assert frontier.analyse(synthetic_store(seeds=()), "toy")["verdicts"] == []
  two = frontier.analyse(synthetic_store(seeds=(1, 2)), "toy")
  [d] = [d for d in two["decisions"] if d["target_budget_share"] == 0.5]
  assert d["seeds"] == 2 and d["adaptive_vs_constant"]["seeds"] == 2


def test_a_target_that_no_ramp_or_rule_reaches_on_every_seed_names_no_best_one():
  """Every ramp and adaptive rule misses the full budget's target on some seed: neither the best
  ramp nor the best rule is the first in the protocol's order (whose mean is as unbounded as the
  others'): there is none, and the decision row says why."""
  records = synthetic_store()
  constants = {f"B={size}" for size in (8, 16, 32, 64)}
  for r in records:  # 0.1 nats worse from the budget 1.0 on, on the odd seeds
    if r["method"] not in constants and r["seed"] % 2 and r["budget_index"] >= 3:
      r["final_val_loss"] += 0.1
  results = frontier.analyse(records, "toy")
  [full] = [d for d in results["decisions"] if d["target_budget_share"] == 1.0]
  assert full["best_ramp"] is None and full["best_adaptive"] is None
  assert full["adaptive_vs_constant"] is None and full["goal_vs_constant"] is None
  at_full = [v for v in results["verdicts"] if v["target_budget_share"] == 1.0]
  assert at_full and all(v["steps_ratio"] is None for v in at_full)
  assert {v["reached"] for v in at_full} == {0, 5}  # the others are 0.3 nats worse everywhere
  assert {v["against"] for v in at_full} == {"best_constant"}  # no ramp to compare with
  [row] = [
    line
    for line in verdict_report.decision_table({**results, **_status()}).splitlines()
    if line.startswith("| 1: ")
  ]
  assert row.split(" | ")[2:4] == ["none on every seed", "none on every seed"]
  [half] = [d for d in results["decisions"] if d["target_budget_share"] == 0.5]
  assert (half["best_ramp"], half["best_adaptive"]) == ("doubling_warmup@peak", "allowance@full")


def test_a_best_constant_that_misses_its_own_target_on_some_seed_settles_nothing_there():
  """The target is the best constant batch's mean loss, so some of its seeds may end above it. A
  method that misses the target on some seed too has no ratio to it: neither reaches it on every
  seed, which is neither "fewer" nor "more steps"."""
  records = synthetic_store()
  for r in records:  # B=16's seeds 9 and 10 end 0.05 nats worse from the budget 1.0 on
    if r["method"] == "B=16" and r["seed"] in (9, 10) and r["budget_index"] >= 3:
      r["final_val_loss"] += 0.05
  results = frontier.analyse(records, "toy")
  [full] = [t for t in results["targets"] if t["budget_share"] == 1.0]
  assert full["best_constant"] == "B=16" and "mean_loss" not in full
  at_full = {
    v["method"]: v
    for v in results["verdicts"]
    if v["target_budget_share"] == 1.0 and v["against"] == "best_constant"
  }
  neither = at_full["gns@full"]  # 0.3 nats worse: never reaches it
  assert (neither["reached"], neither["comparator_reached"], neither["seeds"]) == (0, 8, 10)
  assert neither["steps_ratio"] is None and neither["steps_ratio_ci"] == [None, None]
  assert neither["outcome"] == frontier.NEITHER_REACHES
  reaches = at_full["allowance@full"]  # reaches it on every seed, so its mean is below
  assert reaches["steps_ratio"] == 0.0 and reaches["outcome"] == "fewer steps"
  # gns@full's earlier targets (never reached, B=16 reaching them) each settle "more steps".
  assert results["runs_needed"]["gns@full"]["settled_targets"] == 3
  rows = {
    line.split(" | ")[0][2:]: line.split(" | ")[1:]
    for line in verdict_report.methods_table(results, "best_constant").splitlines()[2:]
  }
  last = [t["budget_share"] for t in results["targets"]].index(1.0)
  assert rows["gns@full"][last].startswith(
    "neither on every seed (0 of 10 seeds reached it, B=16 8)"
  )


def test_workers_share_the_evaluation_frontiers_and_leave_the_tuning_to_the_first():
  runs = frontier.Runs(synthetic_store(seeds=(1,)))  # tuned, seed 1 done: seeds 2 to 10 left
  whole = verdict_lm.pending(runs)
  shares = [verdict_lm.pending(runs, (i, 3)) for i in range(3)]
  assert sorted(sum(shares, [])) == sorted(whole) and len(whole) == 9 * 16
  assert all(not set(a) & set(b) for a in shares for b in shares if a is not b)
  assert [len(share) for share in shares] == [48, 48, 48]
  # A worker's share does not move as frontiers finish: counted in the whole list.
  done = frontier.Runs(synthetic_store(seeds=(1, 2)))
  assert verdict_lm.pending(done, (1, 3)) == [f for f in shares[1] if f[2] != 2]
  tuning = frontier.Runs([r for r in synthetic_store(seeds=()) if r["method"] != "gns@full"])
  assert verdict_lm.pending(tuning, (0, 2)) == verdict_lm.pending(tuning)
  assert verdict_lm.pending(tuning)[0][0] == "gns@full" and verdict_lm.pending(tuning, (1, 2)) == []


@pytest.mark.parametrize("text", ["2/2", "1", "a/b", "-1/2", "0/0"])
def test_a_worker_out_of_range_is_refused_naming_what_is_valid(text):
  with pytest.raises(Exception, match=r"give I/N, worker I of N processes, with 0 <= I < N"):
    verdict_lm.parse_worker(text)


def test_processes_appending_to_one_store_at_once_write_whole_lines(tmp_path):
  """Two processes append long lines (curves of thousands of points) to one store at once: every
  line reads back whole, each store sees the other's after a reload, and the header is written
  once."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  path = tmp_path / "runs.jsonl"
  code = (
    "import sys\n"
    "from benchmarks.lm.run_store import RunStore\n"
    f"store = RunStore({str(path)!r}, {{'task': 'toy'}})\n"
    "for i in range(40):\n"
    "  store.put(f'{sys.argv[1]}-{i}', {'curve': [[i, i, 0.5]] * 3000})\n"
  )
  root = str(ROOT)
  writers = [
    subprocess.Popen([sys.executable, "-c", code, name], cwd=root) for name in ("a", "b", "c")
  ]
  assert [w.wait(timeout=120) for w in writers] == [0, 0, 0]
  lines = path.read_text().splitlines()
  assert len(lines) == 1 + 3 * 40 and json.loads(lines[0]) == {"experiment": {"task": "toy"}}
  store = RunStore(path, {"task": "toy"})
  assert len(store.runs) == 120 and store.runs["b-39"]["curve"][-1] == [39, 39, 0.5]
  other = RunStore(path, {"task": "toy"})
  other.put("d-0", {"curve": []})
  assert store.reload() == 1 and "d-0" in store.runs and store.reload() == 0


def test_workers_writing_a_tasks_json_at_once_leave_it_whole(tmp_path):
  """Each worker writes the task's JSON when its share ends, maybe as another does: every write
  goes through a file of its own, so none fails and the JSON reads whole."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  out = tmp_path / "lm_toy.json"
  code = (
    "import pathlib\n"
    "from benchmarks.lm import verdict_lm\n"
    "for i in range(60):\n"
    f"  verdict_lm.write_json({{'runs': [[i] * 20000]}}, pathlib.Path({str(out)!r}))\n"
  )
  writers = [
    subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE)
    for _ in range(3)
  ]
  assert [w.wait(timeout=120) for w in writers] == [0, 0, 0], writers[0].stderr.read()
  assert len(json.loads(out.read_text())["runs"][0]) == 20000
  assert [p.name for p in tmp_path.iterdir()] == ["lm_toy.json"]  # no partial file left


def test_the_order_tunes_the_constants_then_every_method_then_interleaves_the_seeds():
  records = []
  runs = frontier.Runs(records)
  assert verdict_lm.pending(runs) == [(f"B={b}", m, 0) for b in (8, 16, 32, 64) for m in (2, 4, 8)]
  full = synthetic_store(seeds=())
  constants_only = [r for r in full if r["method"].startswith("B=")]
  todo = verdict_lm.pending(frontier.Runs(constants_only))
  assert todo[:3] == [("step_schedule@full", m, 0) for m in (2, 4, 8)]
  assert len(todo) == 3 * len(P.ramp_and_adaptive_methods())
  todo = verdict_lm.pending(frontier.Runs(full))
  assert len(todo) == 16 * len(P.EVALUATION_SEEDS)
  assert [t[2] for t in todo[:16]] == [1] * 16 and todo[16][2] == 2
  assert todo[0] == ("B=8", 4.0, 1) and todo[15] == ("gns@peak", 4.0, 1)


def test_only_parses_a_method_a_seed_and_a_multiplier():
  assert verdict_lm.parse_only("method=allowance@peak,seed=3") == ("allowance@peak", 3, None)
  with pytest.raises(Exception, match=r"method=NAME,seed=K"):
    verdict_lm.parse_only("method=B=8")
  with pytest.raises(ValueError, match="unknown method 'cubic@full'"):
    verdict_lm.parse_only("method=cubic@full,seed=1")


# 150 windows: the budgets' 75 and 150 examples decay from 60 and 120, which a batch of 8 reaches
# only by cutting a step short.
TINY = P.Task("toy", None, seq_length=8, hidden=16, layers=1, budget_windows=150, eval_windows=8,
              stable_points=3, decay_points=2)  # fmt: skip


@pytest.fixture(name="tiny")
def fixture_tiny(tmp_path):
  rng = np.random.default_rng(0)
  words = ("the", "king", "and", "queen", "of", "rome", "shall", "speak")
  text = tmp_path / "generated.txt"
  text.write_text(" ".join(words[i] for i in rng.integers(0, len(words), 1500)))
  task = P.Task(**{**TINY.__dict__, "text_files": lambda: str(text)})
  return {"toy": task}, tmp_path


@mock.patch.object(P, "BUDGET_SHARES", (0.5, 1.0))  # two budgets: fewer Trainers to build
@mock.patch.object(P, "REFERENCE_BUDGET", 1)
def test_a_frontier_runs_resumes_after_a_kill_and_repeats_exactly(tiny):
  tasks, tmp_path = tiny
  argv = ["--task", "toy", "--results", str(tmp_path / "results"), "--state-dir",
          str(tmp_path / "state"), "--only", "method=B=8,seed=0,lr=4"]  # fmt: skip
  store = tmp_path / "results" / "lm_toy_runs.jsonl"
  from benchmarks.lm import wsd  # pylint: disable=import-outside-toplevel

  decay = wsd._decay
  calls = []

  def killed_at_the_second(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return decay(*args, **kwargs)

  with mock.patch.object(wsd, "_decay", side_effect=killed_at_the_second):
    with pytest.raises(KeyboardInterrupt):
      verdict_lm.main(argv, tasks)
  assert len(store.read_text().splitlines()) == 1 + 1  # the header and the first decay
  assert (tmp_path / "state" / "toy" / "B=8-x4-seed0" / "stable").exists()
  assert verdict_lm.main(argv, tasks) == 1  # the rest, from the stable run's checkpoint
  assert not (tmp_path / "state" / "toy" / "B=8-x4-seed0").exists()
  result = json.loads((tmp_path / "results" / "lm_toy.json").read_text())
  runs = sorted(result["runs"], key=lambda r: r["budget_index"])
  assert [r["budget_index"] for r in runs] == [0, 1]
  assert [r["tokens"] for r in runs] == [75 * 8, 150 * 8]
  assert all(r["code"] == common.code_version() and r["code"]["commit"] for r in runs)
  for r in runs:
    assert r["curve"][0][:2] == [0, 0] and r["curve"][-1][1] == r["tokens"]
    assert r["curve"][-1][2] == r["final_val_loss"] and r["steps"] == r["curve"][-1][0]
    assert r["decay_start_tokens"] == round(0.8 * r["budget_tokens"] / 8) * 8
  # Trained again from the start, uninterrupted: the same decays, to the last digit.
  again = tmp_path / "again"
  verdict_lm.main([*argv[:2], "--results", str(again), "--state-dir", str(again / "s"),
                   *argv[-2:]], tasks)  # fmt: skip
  rerun = json.loads((again / "lm_toy.json").read_text())["runs"]
  assert sorted((r["budget_index"], r["curve"], r["steps"]) for r in rerun) == [
    (r["budget_index"], r["curve"], r["steps"]) for r in runs
  ]
  # The stable run's files lost (another machine) with the first decay recorded: it trains again
  # from the start, its segment ending at the first decay's start as before, the same run.
  lines = store.read_text().splitlines()
  store.write_text("\n".join(lines[:-1]) + "\n")
  assert verdict_lm.main(argv, tasks) == 1
  again = json.loads((tmp_path / "results" / "lm_toy.json").read_text())["runs"]
  [last] = [r for r in again if r["budget_index"] == 1]
  assert (last["curve"], last["steps"]) == (runs[1]["curve"], runs[1]["steps"])
  assert result["experiment"]["text"]["sha256_16"] and result["verdicts"] == []
  assert result["tuning"]["constants"]["per_size"]["8"]["losses"] == {
    "4": runs[1]["final_val_loss"]
  }


def test_the_launcher_runs_at_low_priority_and_goes_on_after_a_stop(tmp_path):
  import subprocess  # pylint: disable=import-outside-toplevel

  fake = tmp_path / "python"  # each worker's first call fails, as a killed run would
  fake.write_text(
    f'#!/bin/sh\necho "$@ nice=$(nice)" >> {tmp_path}/calls\n'
    f"w=$(echo \"$@\" | sed 's/.*--worker \\([0-9]*\\).*/\\1/')\n"
    f"[ -e {tmp_path}/once$w ] || {{ touch {tmp_path}/once$w; exit 9; }}\n"
  )
  fake.chmod(0o755)
  script = pathlib.Path(verdict_lm.__file__).with_name("run_lm_verdict.sh")
  env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "LM_LOGS": str(tmp_path / "logs")}
  assert subprocess.run([str(script), "--foreground"], env=env, check=False).returncode == 0
  calls = sorted((tmp_path / "calls").read_text().splitlines())
  assert calls == [
    f"benchmarks/lm/verdict_lm.py --task all --worker {w}/2 nice=19" for w in (0, 0, 1, 1)
  ]  # two workers by default, each called again after its stop
  for log in ("lm_verdict.log", "lm_verdict.1.log"):
    assert "stopped (exit 9); resuming" in (tmp_path / "logs" / log).read_text()
  assert int((tmp_path / "logs/run_lm_verdict.pgid").read_text()) > 0


def test_the_docs_blocks_are_the_committed_json():
  root = ROOT
  text = (root / "docs" / "results.md").read_text("utf-8")
  command = "python benchmarks/lm/verdict_lm.py --task all --analyse --update-docs"
  start, end = verdict_lm.DOCS_MARKERS
  assert start in text and end in text, "docs/results.md lost the markers of the LM verdict"
  block = text[text.index(start) + len(start) : text.index(end)]
  results = [
    json.loads((root / "benchmarks" / "results" / f"lm_{name}.json").read_text("utf-8"))
    for name in P.TASK_ORDER
  ]
  assert block == "\n".join(verdict_report.markdown(r) for r in results), (
    f"docs/results.md's LM verdict differs from benchmarks/results/lm_*.json; regenerate it "
    f"with {command}"
  )
  for r in results:  # the JSON's runs are the store's (which may have gone on since), curves too
    store = root / "benchmarks" / "results" / f"lm_{r['task']}_runs.jsonl"
    stored = list(RunStore(store, r["experiment"]).runs.values())
    assert len(r["runs"]) == r["decays_stored"] <= len(stored)
    assert all(run in stored and run["curve"] for run in r["runs"])


@pytest.mark.parametrize("steps, expected", [(0.4, True), (0.7, False)])
def test_the_goal_is_a_json_bool_when_the_ratios_are_numpy_floats(steps, expected):
  row = {
    "steps_ratio": np.float64(steps),
    "steps_ratio_ci": [np.float64(steps - 0.05), np.float64(steps + 0.05)],
    "tokens_ratio": np.float64(1.0),
  }
  met = frontier.meets_goal(row)
  assert met is expected  # a Python bool, which json.dumps writes
  assert json.loads(json.dumps({"goal": met})) == {"goal": expected}


def test_a_ratio_over_a_comparator_that_never_reaches_the_target_is_named_not_printed_as_zero():
  steps = frontier.ratio_interval([100.0, 120.0], [math.inf, 200.0])
  assert steps[0] == 0.0  # a finite mean over an unbounded one
  assert "never reaches" in verdict_report._ratio(steps[0], [steps[1], steps[2]])
