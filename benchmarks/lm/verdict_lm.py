"""Benchmark: the language-model verdict, a constant batch, a ramp or an adaptive rule, on two tasks.

Runs the protocol of ``docs/lm_protocol.md`` (settings in
``benchmarks/lm/protocol.py``): for each method, learning rate and seed, a
warmup-stable-decay frontier (``benchmarks/lm/wsd.py``), in the order that
makes a partial store most informative (the tuning seed's grids, then the
evaluation seeds interleaved across methods). Each decay's record is
appended to the task's run store, ``benchmarks/results/lm_<task>_runs.jsonl``,
as it ends; the result JSON ``benchmarks/results/lm_<task>.json`` (every run
with its curve, the tuning, the targets, ``verdicts``, ``decisions`` and
``runs_needed``: ``benchmarks/lm/frontier.py``) is written from the store
when the task's runs end, or by ``--analyse`` (with ``--update-docs``, and
docs/results.md's blocks from it, and each task's frontiers plotted in
``docs/lm_<task>.png``: what a commit of a partial store takes).
Killed and started again, it goes on from the store; the stable runs'
checkpoints live under ``--state-dir``.

Usage::

  python benchmarks/lm/verdict_lm.py --task shakespeare           # what the store lacks, in order
  python benchmarks/lm/verdict_lm.py --task all --max-frontiers 3  # stop after three frontiers
  python benchmarks/lm/verdict_lm.py --task all --worker 1/2       # the second of two processes
  python benchmarks/lm/verdict_lm.py --task shakespeare --only method=allowance@full,seed=3
  python benchmarks/lm/verdict_lm.py --task shakespeare --only method=B=16,seed=0,lr=4
  python benchmarks/lm/verdict_lm.py --task shakespeare --analyse  # the JSON from the store
  python benchmarks/lm/verdict_lm.py --task all --analyse --update-docs  # JSON and docs, to commit
  python benchmarks/lm/verdict_lm.py --task all --markdown         # docs/results.md's blocks

``--only`` runs one frontier: ``lr`` is the learning-rate multiplier, by
default the method's tuned one. ``--worker I/N`` shares the evaluation
frontiers among N processes on the same stores (a frontier's numbers do not
depend on which process ran it, nor on the machine's load).
``benchmarks/lm/run_lm_verdict.sh`` runs both tasks in the background at low
priority, in ``LM_WORKERS`` such processes (2 by default).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
  from benchmarks import common  # noqa: E402  (imports no JAX)

  common.prepare_script()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.lm import frontier  # noqa: E402
from benchmarks.lm import protocol as P  # noqa: E402
from benchmarks.lm import verdict_plot  # noqa: E402
from benchmarks.lm import verdict_report  # noqa: E402
from benchmarks.lm.run_store import RunStore  # noqa: E402
from benchmarks.pareto.protocol import RunSpec  # noqa: E402
from simigrad_jax.compile import persistent_cache  # noqa: E402

RESULTS = pathlib.Path(common.RESULTS_DIR)  # lm_<task>.json and the run stores, one a task
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results.md"
MARKDOWN_COMMAND = "python benchmarks/lm/verdict_lm.py --task all --markdown"
DOCS_MARKERS = (
  f"<!-- lm_verdict blocks: {MARKDOWN_COMMAND} -->\n",
  "\n<!-- end lm_verdict blocks -->",
)
Frontier = tuple[str, float, int]  # (method, learning-rate multiplier, seed)


def branch_key(method: str, multiplier: float, seed: int, budget_index: int) -> str:
  """A decay's identity in the store."""
  return json.dumps([method, f"{multiplier:g}", seed, budget_index])


def pending(runs: frontier.Runs, worker: tuple[int, int] = (0, 1)) -> list[Frontier]:
  """The frontiers still to run, in the protocol's order.

  First the constant sizes' tuning (``B_0`` comes from it), then every
  method's tuning, then the evaluation seeds: seed 1 of every method, then
  seed 2, and so on. Tuning comes out a step at a time (which learning rate
  or size is next depends on the losses so far), so the list is recomputed
  after each frontier.

  Args:
    runs: the task's runs so far.
    worker: ``(i, n)``: worker ``i`` of ``n`` processes that share the store
      takes every ``n``-th evaluation frontier from its ``i``-th (counted in
      the whole list, done or not, so the workers' shares never meet); the
      tuning, which follows the losses one frontier at a time, is worker 0's
      alone (the others have none pending until it ends).
  """
  index, count = worker
  constants = runs.constant_tuning()
  if constants["to_tune"]:
    tuning = [
      (f"B={b}", m, P.TUNING_SEED)
      for b in constants["to_tune"]
      for m in runs.tune(f"B={b}")["to_run"]
    ]
    return tuning if index == 0 else []
  methods = [m.name for m in P.ramp_and_adaptive_methods()]
  tuning = [(n, m, P.TUNING_SEED) for n in methods for m in runs.tune(n)["to_run"]]
  if tuning:
    return tuning if index == 0 else []
  tuned = {f"B={b}": constants["per_size"][str(b)]["best"] for b in constants["sizes"]}
  tuned |= {n: runs.tune(n)["best"] for n in methods}
  evaluation = [
    (name, multiplier, seed) for seed in P.EVALUATION_SEEDS for name, multiplier in tuned.items()
  ]
  return [
    one for i, one in enumerate(evaluation) if i % count == index and runs.frontier(*one) is None
  ]


class TaskRunner:
  """One task's store, its runs and how to train a frontier.

  Args:
    task: the task.
    store_path: the run store (JSON lines), or None to keep it in memory.
    state_dir: where stable runs keep their checkpoints between segments.
  """

  def __init__(
    self,
    task: P.Task,
    store_path: pathlib.Path | None,
    state_dir: pathlib.Path,
    root: pathlib.Path,
  ):
    self.task, self.state_dir, self.root = task, state_dir, root
    self._exp: Any = None
    self.store = RunStore(store_path, self.experiment())

  def experiment(self) -> dict[str, Any]:
    """The task's training settings and its text's hash: what its stored runs share.

    The analysis's settings (targets, bootstrap, grids) are not in it: the
    analysis is computed again from the runs, by the code at hand.
    """
    return {**self.task.experiment(), "text": self.text_identity()}

  def text_identity(self) -> dict[str, Any]:
    """The text's hash (and for the standard library, the Python version that holds it)."""
    from train import char_data  # pylint: disable=import-outside-toplevel

    config = _config(self.task)
    text, _ = char_data.read_text(config)
    out: dict[str, Any] = {"sha256_16": P.text_hash(text), "characters": len(text)}
    if self.task.text_files is not None:
      out["python"] = platform.python_version()
    return out

  @property
  def records(self) -> list[dict[str, Any]]:
    return list(self.store.runs.values())

  def exp(self) -> Any:
    """The task's :class:`~benchmarks.lm.experiment.LmExperiment`, built on first use."""
    if self._exp is None:
      from benchmarks.lm.experiment import LmExperiment  # pylint: disable=import-outside-toplevel

      t = self.task
      self.root.mkdir(parents=True, exist_ok=True)
      self._exp = LmExperiment(
        hidden=t.hidden,
        seq_length=t.seq_length,
        budget_windows=t.budget_windows,
        # the training windows: the first 1.1 budgets', or (a large share) all there are
        max_share=1e6 if t.whole_text else max(P.BUDGET_SHARES),
        eval_windows=t.eval_windows,
        evals=t.stable_points,
        root=self.root,
        text_file=None if t.text_files is None else t.text_files(),
        layers=t.layers,
      )
    return self._exp

  def spec(self, method_name: str, multiplier: float, seed: int) -> RunSpec:
    """The run of ``method_name`` at ``multiplier`` with ``seed`` (``B_0`` from the tuning)."""
    method = P.method_by_name(method_name)
    if method.kind == "constant":
      assert method.batch_size is not None
      b0 = method.batch_size
    else:
      b0 = frontier.Runs(self.records).constant_tuning()["b0"]
      if b0 is None:
        raise ValueError(
          f"{method_name} starts at B_0, the tuning seed's best constant size at the shortest "
          "budget: tune the constant sizes first"
        )
    options = tuple(sorted(P.controller_options(method, b0, self.task).items()))
    lr = multiplier * P.base_lr(b0)
    return RunSpec(method.controller, options, lr, multiplier, seed, "sqrt", method.coupling)

  def run(self, method_name: str, multiplier: float, seed: int) -> None:
    """Trains one frontier's missing decays, each stored as it ends."""
    from benchmarks.lm import wsd  # pylint: disable=import-outside-toplevel

    spec = self.spec(method_name, multiplier, seed)
    keys = [branch_key(method_name, multiplier, seed, k) for k in range(len(P.BUDGET_SHARES))]
    done = {k for k, key in enumerate(keys) if key in self.store.runs}
    role = "tuning" if seed == P.TUNING_SEED else "evaluation"
    print(f"{self.task.name}: {method_name} lr x{multiplier:g} seed {seed} ({role})", flush=True)

    code = common.code_version()  # which code trained it: the protocol is fixed, its code too

    def on_branch(k: int, record: dict[str, Any]) -> None:
      record = {
        "task": self.task.name,
        "method": method_name,
        "role": role,
        "budget_index": k,
        "budget_share": P.BUDGET_SHARES[k],
        **record,
        "code": code,
      }
      self.store.put(keys[k], record)
      print(
        f"  budget {P.BUDGET_SHARES[k]:g}: val loss {record['final_val_loss']:.4f}, "
        f"{record['steps']} steps, {record['tokens']:,} tokens, avg B "
        f"{record['avg_batch_size']:.1f}, {record['wall_seconds']:.0f} s",
        flush=True,
      )

    exp = self.exp()
    wsd.run_frontier(
      exp,
      spec,
      budgets=wsd.budget_examples(self.task),
      longest=self.task.budget_windows,
      state_dir=self.state_dir / f"{method_name}-x{multiplier:g}-seed{seed}",
      stable_points=self.task.stable_points,
      decay_points=self.task.decay_points,
      done=done,
      on_branch=on_branch,
    )

  def results(self) -> dict[str, Any]:
    """The task's result JSON, from the store."""
    records = sorted(
      self.records,
      key=lambda r: (r["role"] != "tuning", r["seed"], r["method"], r["lr_multiplier"],
                     r["budget_index"]),
    )  # fmt: skip
    analysis = frontier.analyse(records, self.task.name)
    return {
      "task": self.task.name,
      "experiment": self.store.experiment,
      "protocol": "docs/lm_protocol.md",
      "budget_shares": list(P.BUDGET_SHARES),
      "budget_tokens": [round(s * self.task.budget_tokens) for s in P.BUDGET_SHARES],
      "tuning_seed": P.TUNING_SEED,
      "evaluation_seeds_planned": list(P.EVALUATION_SEEDS),
      "frontiers_finished": len({(r["method"], r["lr_multiplier"], r["seed"]) for r in records})
      - len(_unfinished(records)),
      "frontiers_pending": len(pending(frontier.Runs(records))),
      "decays_stored": len(records),
      "train_seconds": round(sum(r["wall_seconds"] for r in records), 1),
      **analysis,
      "runs": records,
    }


def write_json(results: Mapping[str, Any], path: pathlib.Path) -> None:
  """Writes ``results`` to ``path`` at once (a kill leaves the previous file whole; of workers
  writing it together, each writes a file of its own and the last replaces it whole)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
  partial.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n", "utf-8")
  os.replace(partial, path)


def _unfinished(records: Sequence[Mapping[str, Any]]) -> set[tuple[str, float, int]]:
  counts: dict[tuple[str, float, int], int] = {}
  for r in records:
    key = (r["method"], r["lr_multiplier"], r["seed"])
    counts[key] = counts.get(key, 0) + 1
  return {k for k, n in counts.items() if n < len(P.BUDGET_SHARES)}


def _config(task: P.Task) -> Any:
  from train.configs import shakespeare_lm  # pylint: disable=import-outside-toplevel

  config = shakespeare_lm.get_config()
  if task.text_files is not None:
    config.text_files = task.text_files()
  return config


def parse_only(text: str) -> tuple[str, int, float | None]:
  """``method=NAME,seed=K[,lr=MULTIPLIER]`` as ``(NAME, K, MULTIPLIER or None)``.

  Example:
    >>> parse_only("method=B=16,seed=0,lr=4")
    ('B=16', 0, 4.0)
  """
  fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
  unknown = sorted(set(fields) - {"method", "seed", "lr"})
  if unknown or "method" not in fields or "seed" not in fields:
    raise argparse.ArgumentTypeError(
      f"--only {text!r}: give method=NAME,seed=K[,lr=MULTIPLIER] (unknown or missing: "
      f"{unknown or [k for k in ('method', 'seed') if k not in fields]})"
    )
  P.method_by_name(fields["method"])
  try:
    seed = int(fields["seed"])
    lr = float(fields["lr"]) if "lr" in fields else None
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"--only {text!r}: {e}") from e
  return fields["method"], seed, lr


def parse_worker(text: str) -> tuple[int, int]:
  """``I/N`` (worker ``I`` of ``N``, 0 <= I < N) as ``(I, N)``.

  Example:
    >>> parse_worker("1/2")
    (1, 2)
  """
  try:
    index, count = (int(part) for part in text.split("/"))
  except ValueError:
    index, count = -1, 0
  if not 0 <= index < count:
    raise argparse.ArgumentTypeError(
      f"--worker {text!r}: give I/N, worker I of N processes, with 0 <= I < N (e.g. 1/2)"
    )
  return index, count


def _parse_args(argv: Sequence[str] | None, tasks: Mapping[str, P.Task]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument(
    "--task", choices=[*tasks, "all"], default="all", help="which task (all: in order)"
  )
  p.add_argument("--only", type=parse_only, default=None, help="method=NAME,seed=K[,lr=M]")
  p.add_argument("--analyse", action="store_true", help="write the JSON from the store; no runs")
  p.add_argument(
    "--markdown", action="store_true", help="print the docs' section of lm_<task>.json; no runs"
  )
  p.add_argument(
    "--update-docs",
    action="store_true",
    help="after the runs (or --analyse), rewrite docs/results.md's blocks and plot "
    "docs/lm_<task>.png from the JSON",
  )
  p.add_argument("--max-frontiers", type=int, default=None, help="stop after this many frontiers")
  p.add_argument(
    "--worker",
    type=parse_worker,
    default=(0, 1),
    help="I/N: one of N processes sharing the stores, running every N-th evaluation frontier "
    "from the I-th (the tuning is worker 0's); default 0/1",
  )
  p.add_argument("--results", default=str(RESULTS), help="where lm_<task>.json and stores go")
  p.add_argument(
    "--state-dir",
    default=str(RESULTS / "logs" / "lm_state"),
    help="the stable runs' checkpoints between segments (not committed)",
  )
  args = p.parse_args(argv)
  if args.only and args.task == "all":
    p.error("--only runs one frontier of one task: give --task too")
  return args


def _run_task(
  runner: TaskRunner, args: argparse.Namespace, out: pathlib.Path, trained_before: int
) -> int:
  """One task's frontiers (``--only``'s, or those pending, up to ``--max-frontiers`` in all), then
  its JSON; returns how many were trained."""
  trained = 0
  if args.only:
    method, seed, lr = args.only
    if lr is None:
      lr = frontier.Runs(runner.records).tune(method)["best"]
      if lr is None:
        raise SystemExit(
          f"{method} is not tuned yet on {runner.task.name}: give its multiplier, lr=M"
        )
    runner.run(method, lr, seed)
    trained += 1
  elif not args.analyse:
    while args.max_frontiers is None or trained_before + trained < args.max_frontiers:
      todo = pending(frontier.Runs(runner.records), args.worker)
      if not todo:
        break
      runner.run(*todo[0])
      trained += 1
  runner.store.reload()  # (other workers' runs too)
  write_json(runner.results(), out)
  print(f"wrote {out}", flush=True)
  return trained


def main(argv: Sequence[str] | None = None, tasks: Mapping[str, P.Task] = P.TASKS) -> int:
  """Runs (or analyses) the protocol; returns the number of frontiers trained.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).
    tasks: the tasks by name (the protocol's; tests give tiny ones).
  """
  args = _parse_args(argv, tasks)
  names = [args.task] if args.task != "all" else [n for n in P.TASK_ORDER if n in tasks] or [*tasks]
  results_dir = pathlib.Path(args.results)
  if args.markdown:
    print(_markdown(results_dir, names))
    return 0
  # One folder for the process's tasks: their compilation cache and workdirs; JAX's cache
  # settings put back when it goes, so that later compiles in this process (tests) do not
  # write into a folder that is gone.
  with (
    persistent_cache.persistent_cache_settings(),
    tempfile.TemporaryDirectory(prefix="simigrad-lm-verdict-") as root,
  ):
    trained = 0
    for name in names:
      runner = TaskRunner(
        tasks[name],
        results_dir / f"lm_{name}_runs.jsonl",
        pathlib.Path(args.state_dir) / name,
        pathlib.Path(root) / name,
      )
      trained += _run_task(runner, args, results_dir / f"lm_{name}.json", trained)
      if args.max_frontiers is not None and trained >= args.max_frontiers:
        break
  if args.update_docs:
    update_docs(_markdown(results_dir, names), DOCS)
    print(f"wrote {DOCS}'s LM verdict", flush=True)
    for name in names:
      results = json.loads((results_dir / f"lm_{name}.json").read_text("utf-8"))
      if verdict_plot.mean_frontiers(results):  # (none before a method's first evaluation seed)
        print(f"wrote {verdict_plot.plot(results, DOCS.parent / f'lm_{name}.png')}", flush=True)
  return trained


def _markdown(results_dir: pathlib.Path, names: Sequence[str]) -> str:
  """docs/results.md's blocks of ``names``, from their ``lm_<task>.json``."""
  return "\n".join(
    verdict_report.markdown(json.loads((results_dir / f"lm_{n}.json").read_text("utf-8")))
    for n in names
  )


def update_docs(block: str, page: pathlib.Path) -> None:
  """Replaces the LM verdict's generated block of ``page`` (between its markers) with ``block``."""
  text = page.read_text("utf-8")
  start, end = DOCS_MARKERS
  if start not in text or end not in text:
    raise ValueError(f"{page} lost the markers of the LM verdict: {start.strip()!r}")
  head, tail = text[: text.index(start) + len(start)], text[text.index(end) :]
  page.write_text(head + block + tail, "utf-8")


if __name__ == "__main__":
  main(sys.argv[1:])
