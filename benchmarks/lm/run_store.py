"""The finished runs of ``benchmarks/lm/pareto_lm.py``, kept on disk as each ends, so that a killed comparison resumes.

A :class:`RunStore` appends each finished run to a JSON-lines file
(``OUT.runs.jsonl`` beside the result's JSON) the moment it ends, and on the
next start reads them back: a run already there is not trained again. The
file's first line holds the experiment (task, budget, model, protocol
settings); a store opened for another experiment is refused, naming what
differs, so that runs of two comparisons never mix. A last line cut short
by a kill is dropped. :meth:`RunStore.read_back` takes the runs of a
finished comparison's JSON, so that one given a new setting trains only it.
Several processes may append to one store at once (the LM verdict's
workers): each line is written whole under an exclusive lock on the file,
and the experiment's line only by the first; :meth:`RunStore.reload` reads
back what the others appended.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

from benchmarks.pareto.protocol import RunSpec


def run_key(spec: RunSpec, share: float) -> str:
  """The identity of a run: its controller, options, learning rate, rules, seed and budget share."""
  return json.dumps(
    [
      spec.controller,
      [[k, v] for k, v in spec.options],
      f"{spec.lr:.10g}",
      spec.lr_rule,
      spec.lr_coupling,
      spec.seed,
      f"{share:.10g}",
    ]
  )


class RunStore:
  """Finished runs by :func:`run_key`, appended to ``path`` (None: kept in memory only).

  Args:
    path: the JSON-lines file, or None.
    experiment: what the runs belong to (JSON data); a file written for
      another experiment is refused with a ValueError naming the keys that
      differ.

  Example::

    store = RunStore("benchmarks/results/pareto_lm.json.runs.jsonl", {"budget": 12288})
    run = store.get_or_run(spec, 1.0, lambda: exp.run(spec, label))
  """

  def __init__(self, path: str | os.PathLike | None, experiment: dict[str, Any]):
    self.path = None if path is None else pathlib.Path(path)
    self.experiment = json.loads(json.dumps(experiment))
    self.runs: dict[str, dict[str, Any]] = {}
    self.resumed = 0
    if self.path is None:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._append({"experiment": self.experiment}, first_only=True)
    self.reload()
    self.resumed = len(self.runs)

  def reload(self) -> int:
    """Reads back the runs the file holds that this store lacks (another process's appends).

    Returns:
      How many were new.
    """
    if self.path is None:
      return 0
    lines = self.path.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0]) if lines else {}
    self._check_experiment(header.get("experiment"), str(self.path))
    new = 0
    for line in lines[1:]:
      try:
        entry = json.loads(line)
      except json.JSONDecodeError:  # the last line, cut short by a kill
        continue
      new += entry["key"] not in self.runs
      self.runs[entry["key"]] = entry["run"]
    return new

  def read_back(self, result: dict[str, Any], source: str) -> int:
    """Takes the runs of a finished comparison's JSON as if they had been trained here.

    So a comparison given one more setting trains only that setting. The
    result must have been written for this store's experiment (its
    ``experiment``); another is refused with a ValueError naming the keys
    that differ. The runs are appended to the file, so a kill after this
    keeps them.

    Args:
      result: the JSON ``benchmarks/lm/pareto_lm.py`` wrote.
      source: where it came from, for the error.

    Returns:
      How many runs were taken (runs already in the store are kept as they are).
    """
    self._check_experiment(result.get("experiment"), source)
    taken = 0
    for run in result["runs"]:
      spec = RunSpec(
        run["controller"],
        tuple(run["options"].items()),
        run["learning_rate"],
        run["lr_multiplier"],
        run["seed"],
        run.get("lr_rule", "sqrt"),
        run["lr_coupling"],
      )
      key = run_key(spec, run["budget_share"])
      if key in self.runs:
        continue
      self.runs[key] = run
      taken += 1
      if self.path is not None:
        self._append({"key": key, "run": run})
    self.resumed += taken
    return taken

  def _check_experiment(self, saved: dict[str, Any] | None, source: str) -> None:
    if saved == self.experiment:
      return
    keys = sorted(
      k
      for k in set(saved or {}) | set(self.experiment)
      if (saved or {}).get(k) != self.experiment.get(k)
    )
    raise ValueError(
      f"{source} holds the runs of another experiment (differs in {keys}); "
      "delete it or write to another --out"
    )

  def _append(self, entry: dict[str, Any], first_only: bool = False) -> None:
    """Appends ``entry`` as one line, whole, under an exclusive lock on the file (other
    processes may append to it too); ``first_only``: only to an empty file (the header)."""
    assert self.path is not None
    with open(self.path, "a", encoding="utf-8") as f:
      fcntl.flock(f, fcntl.LOCK_EX)
      try:
        if first_only and f.seek(0, os.SEEK_END) > 0:
          return
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())
      finally:
        fcntl.flock(f, fcntl.LOCK_UN)

  def get_or_run(
    self, spec: RunSpec, share: float, train: Callable[[], dict[str, Any]]
  ) -> tuple[dict[str, Any], bool]:
    """The run of ``spec`` at ``share`` of the budget: the stored one, or ``train()``'s, stored.

    Returns:
      ``(run, trained)``: ``trained`` is False for a run read back.
    """
    key = run_key(spec, share)
    if key in self.runs:
      return self.runs[key], False
    run = train()
    self.put(key, run)
    return run, True

  def put(self, key: str, run: dict[str, Any]) -> None:
    """Keeps ``run`` under ``key``, appended to the file at once."""
    self.runs[key] = run
    if self.path is not None:
      self._append({"key": key, "run": run})

  def close(self, keep: bool) -> None:
    """Removes the file unless ``keep`` (the comparison finished and wrote its JSON)."""
    if self.path is not None and not keep:
      self.path.unlink(missing_ok=True)
