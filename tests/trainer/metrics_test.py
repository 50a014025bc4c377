"""Tests for simigrad_jax.trainer.metrics: the JSONL/TensorBoard writer and the progress bar."""

import doctest
import io
import json
import math
import os
import re
import struct

import numpy as np
import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from simigrad_jax.checkpoint import missing_steps
from simigrad_jax.trainer import metrics
from simigrad_jax.trainer.metrics import MetricsWriter
from simigrad_jax.trainer.metrics import read_metrics
from simigrad_jax.trainer.progress import ProgressBar

# ------------------------------------------------------------------- helpers


def read_events(logdir):
  """Every Event in the TFRecord event files under ``logdir``, files in name order.

  The record format: uint64 length, masked CRC32C of the length, the payload,
  masked CRC32C of the payload (all little-endian).
  """
  events = []
  for path in sorted(logdir.glob("events.out.tfevents.*")):
    data, pos = path.read_bytes(), 0
    while pos < len(data):
      header = data[pos : pos + 8]
      (length,) = struct.unpack("<Q", header)
      (header_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
      assert header_crc == masked_crc32c(header)
      payload = data[pos + 12 : pos + 12 + length]
      (payload_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
      assert payload_crc == masked_crc32c(payload)
      event = event_pb2.Event()
      event.ParseFromString(payload)
      events.append(event)
      pos += 16 + length
  return events


def scalars(events):
  """``{tag: [(step, value), ...]}`` from the events' simple values."""
  out = {}
  for event in events:
    for value in event.summary.value:
      out.setdefault(value.tag, []).append((event.step, value.simple_value))
  return out


def steps_in(path):
  return [r["step"] for r in read_metrics(path)]


# -------------------------------------------------------------------- writer


def test_records_round_trip(tmp_path):
  records = [
    {
      "step": 1,
      "batch_size": 128,
      "similarity": 0.05,
      "loss": 2.25,
      "decision": "grow",
      "shapes": [16, 32],
      "nested": {"a": 1.5, "b": None},
      "profiling": False,
    },
    {
      "step": 2,
      "batch_size": 140,
      "similarity": -0.125,
      "loss": 2.0,
      "decision": "shrink",
      "shapes": [],
      "nested": {},
      "profiling": True,
    },
    {"step": 2, "eval_accuracy": 0.5},  # several records may share a step
  ]
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    for record in records:
      writer.write(record)
  assert writer.path == tmp_path / "metrics.jsonl"
  assert read_metrics(tmp_path / "metrics.jsonl") == records
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line) for line in lines] == records
  assert not (tmp_path / "tensorboard").exists()


def test_numpy_and_jax_values_become_plain_json(tmp_path):
  import jax.numpy as jnp

  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(
      {
        "step": np.int64(3),
        "a": np.float32(0.5),
        "b": np.int32(7),
        "c": jnp.float32(0.25),
        "d": np.array([1.0, np.nan]),
        "e": np.bool_(True),
      }
    )
  text = (tmp_path / "metrics.jsonl").read_text()
  assert json.loads(text) == {"step": 3, "a": 0.5, "b": 7, "c": 0.25, "d": [1.0, None], "e": True}
  assert type(json.loads(text)["e"]) is bool


def test_writes_after_each_record_without_close(tmp_path):
  writer = MetricsWriter(tmp_path, tensorboard=False)
  writer.write({"step": 1, "loss": 1.0})
  assert steps_in(tmp_path / "metrics.jsonl") == [1]  # flushed, not buffered
  writer.close()
  writer.close()  # twice is fine
  with pytest.raises(RuntimeError, match="closed"):
    writer.write({"step": 2})


def test_appends_to_an_existing_file(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write({"step": 1})
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write({"step": 2})
  assert steps_in(tmp_path / "metrics.jsonl") == [1, 2]


def test_tensorboard_scalars_written_and_readable(tmp_path):
  with MetricsWriter(tmp_path) as writer:
    for step in range(1, 4):
      writer.write(
        {
          "step": step,
          "batch_size": 100 + step,
          "similarity": 0.1 * step,
          "grew": step % 2 == 1,
          "decision": "grow",
          "shapes": [1, 2],
          "jax_value": np.float32(step / 4),
        }
      )
    writer.write({"step": 4, "similarity": math.nan, "loss": math.inf})
  events = read_events(tmp_path / "tensorboard")
  assert events, "no event file written"
  got = scalars(events)
  assert set(got) == {"batch_size", "similarity", "grew", "jax_value", "loss"}
  assert got["batch_size"] == [(1, 101.0), (2, 102.0), (3, 103.0)]
  assert [s for s, _ in got["similarity"]] == [1, 2, 3, 4]
  np.testing.assert_allclose([v for _, v in got["similarity"][:3]], [0.1, 0.2, 0.3], rtol=1e-6)
  assert math.isnan(got["similarity"][3][1])  # TensorBoard keeps the real value
  assert got["loss"] == [(4, math.inf)]
  assert got["grew"] == [(1, 1.0), (2, 0.0), (3, 1.0)]
  assert got["jax_value"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
  # ...while JSON, which has no NaN, gets null.
  assert read_metrics(tmp_path / "metrics.jsonl")[-1] == {
    "step": 4,
    "similarity": None,
    "loss": None,
  }


def test_nonfinite_values_written_as_null(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(
      {
        "step": 1,
        "a": math.nan,
        "b": -math.inf,
        "c": [math.inf, 2.0],
        "d": np.float32("nan"),
        "e": 1.5,
      }
    )
  text = (tmp_path / "metrics.jsonl").read_text()
  assert "NaN" not in text and "Infinity" not in text
  assert json.loads(text) == {
    "step": 1,
    "a": None,
    "b": None,
    "c": [None, 2.0],
    "d": None,
    "e": 1.5,
  }


def test_resume_step_truncates_later_records(tmp_path):
  path = tmp_path / "metrics.jsonl"
  with MetricsWriter(tmp_path) as writer:
    for step in range(1, 11):
      writer.write({"step": step, "loss": float(step)})
      if step % 5 == 0:
        writer.write({"step": step, "eval_accuracy": step / 10})
  with MetricsWriter(tmp_path, resume_step=6) as writer:
    for step in (7, 8):
      writer.write({"step": step, "loss": float(step) + 0.5})
  records = read_metrics(path)
  assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))
  assert [r["step"] for r in records if "eval_accuracy" in r] == [5]  # 10 dropped
  assert [r["loss"] for r in records if "loss" in r][-2:] == [7.5, 8.5]
  # No temporary file left behind.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tensorboard"]
  # TensorBoard is told to hide the old events from step 7 on.
  events = read_events(tmp_path / "tensorboard")
  assert any(
    e.HasField("session_log") and e.session_log.status == e.session_log.START and e.step == 7
    for e in events
  )
  assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_resume_step_zero_and_missing_file(tmp_path):
  with MetricsWriter(tmp_path / "new", tensorboard=False, resume_step=3) as writer:
    writer.write({"step": 4})
  assert steps_in(tmp_path / "new" / "metrics.jsonl") == [4]
  with MetricsWriter(tmp_path / "new", tensorboard=False, resume_step=0) as writer:
    writer.write({"step": 1})
  assert steps_in(tmp_path / "new" / "metrics.jsonl") == [1]


def test_resume_keeps_file_mode(tmp_path):
  path = tmp_path / "metrics.jsonl"
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write({"step": 1})
    writer.write({"step": 2})
  os.chmod(path, 0o640)
  MetricsWriter(tmp_path, tensorboard=False, resume_step=1).close()
  assert steps_in(path) == [1]
  assert os.stat(path).st_mode & 0o777 == 0o640


def test_resume_drops_records_without_step_and_names_them(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"loss": 2.0}\n')
  with caplog.at_level("WARNING", logger="simigrad_jax"):
    MetricsWriter(tmp_path, tensorboard=False, resume_step=5).close()
  assert path.read_text() == '{"step": 1}\n'
  assert "dropped 1 damaged line(s) (line 2)" in caplog.text


@pytest.mark.parametrize("resume_step", [None, 5])
def test_torn_last_line_dropped_on_reopen(tmp_path, resume_step):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
  assert steps_in(path) == [1, 2]  # reading tolerates it
  with MetricsWriter(tmp_path, tensorboard=False, resume_step=resume_step) as writer:
    writer.write({"step": 3, "loss": 3.0})
  assert path.read_text().splitlines() == [
    '{"step": 1, "loss": 1.0}',
    '{"step": 2, "loss": 2.0}',
    '{"step": 3, "loss": 3.0}',
  ]


def test_another_runs_event_file_is_not_restored_from(tmp_path, caplog):
  # Copied into the run's tensorboard/ beside a torn metrics file, its steps were restored as the
  # run's own (other batch sizes and losses).
  with MetricsWriter(tmp_path, tensorboard=True) as writer:
    for step in (1, 2, 3, 4):
      writer.write({"step": step, "batch_size": 8 * step, "loss": 1.0 / step})
  other = tmp_path / "other"
  with MetricsWriter(other, tensorboard=True) as writer:
    for step in (1, 2, 3, 4):
      writer.write({"step": step, "batch_size": 99, "loss": 5.0, "loss_nan": math.nan})
  (foreign,) = (other / "tensorboard").glob("events.out.tfevents.*")
  copied = tmp_path / "tensorboard" / (foreign.name + ".copied")
  copied.write_bytes(foreign.read_bytes())
  os.utime(copied, None)
  path = tmp_path / "metrics.jsonl"
  lines = path.read_text().splitlines()
  path.write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])  # steps 3 and 4 lost
  with caplog.at_level("WARNING", logger="simigrad_jax"):
    MetricsWriter(tmp_path, tensorboard=False, resume_step=4).close()
  assert [(r["step"], r["batch_size"]) for r in read_metrics(path)] == [
    (s, 8 * s) for s in range(1, 5)
  ]
  assert (
    "not restoring from" in caplog.text and "batch_size 99 there, 8 in the metrics" in caplog.text
  )


def test_resume_drops_records_out_of_step_order_and_names_them(tmp_path, caplog):
  # Lines of steps 1-2 copied in again, another run's line and a stray evaluation of step 1: each
  # was kept, counted twice in the epoch's averages, and the stray one read as the final
  # evaluation.
  path = tmp_path / "metrics.jsonl"
  own = [
    {"step": 1, "batch_size": 8, "loss": 1.0},
    {"step": 2, "batch_size": 8, "loss": 0.9},
    {"step": 2, "eval_loss": 0.8},
    {"step": 2, "eval_loss": 0.7},  # a second evaluation of the same step: kept
    {"step": 3, "batch_size": 16, "loss": 0.6},
  ]
  foreign = [
    own[0],
    own[1],
    {"step": 3, "batch_size": 99, "loss": 5.0},
    {"step": 1, "eval_loss": 0},
  ]
  path.write_text("".join(json.dumps(r) + "\n" for r in own + foreign))
  with caplog.at_level("WARNING", logger="simigrad_jax"):
    MetricsWriter(tmp_path, tensorboard=False, resume_step=3).close()
  assert read_metrics(path) == own
  assert "dropped 4 record(s) out of step order (of step(s) 1-3" in caplog.text


def test_an_event_file_of_random_bytes_restores_nothing_and_raises_nothing(tmp_path):
  # Its first "length" was read as about 2**63 bytes, and the read raised an OverflowError that
  # ended the resume as a bug.
  from simigrad_jax.checkpoint import metrics_recovery  # pylint: disable=import-outside-toplevel

  folder = tmp_path / "tensorboard"
  with MetricsWriter(tmp_path, tensorboard=True) as writer:
    for step in (1, 2, 3):
      writer.write({"step": step, "loss": float(step)})
  rng = np.random.default_rng(0)
  (folder / "events.out.tfevents.0.random").write_bytes(
    b"\xff" * 8 + rng.bytes(4) + rng.bytes(4000)
  )
  records = metrics_recovery.records_from_events(folder, up_to=3)
  assert [(r["step"], r["loss"]) for r in records] == [(1, 1), (2, 2), (3, 3)]


def test_last_line_missing_only_its_newline_is_kept(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"step": 2}')
  assert steps_in(path) == [1, 2]
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write({"step": 3})
  assert steps_in(path) == [1, 2, 3]


def test_corrupt_middle_line_is_an_error(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
  with pytest.raises(ValueError, match="line 2"):
    read_metrics(path)
  path.write_text('{"step": 1}\n[1, 2]\n')
  with pytest.raises(ValueError, match="line 2 is not a JSON object"):
    read_metrics(path)


def test_read_metrics_blank_lines_and_missing_file(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n\n{"step": 2}\n')
  assert steps_in(path) == [1, 2]
  path.write_text("")
  assert read_metrics(path) == []
  with pytest.raises(FileNotFoundError):
    read_metrics(tmp_path / "missing.jsonl")


def test_disabled_writer_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  with MetricsWriter(workdir, enabled=False, resume_step=2) as writer:
    writer.write({"step": 1, "loss": 0.5})
    assert not writer.enabled
    with pytest.raises(ValueError, match="step"):  # checks records all the same
      writer.write({"loss": 0.5})
  assert not workdir.exists()
  # An existing file is left alone too, even when resuming.
  workdir.mkdir()
  (workdir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 9}\n')
  MetricsWriter(workdir, enabled=False, resume_step=2).close()
  assert (workdir / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 9}\n'


@pytest.mark.parametrize(
  "record, error, match",
  [
    ({"loss": 1.0}, ValueError, "integer 'step'"),
    ({"step": 1.0}, ValueError, r"record\['step'\] must be an integer >= 0, got 1.0"),
    ({"step": True}, ValueError, r"record\['step'\]"),
    ({"step": -1}, ValueError, "got -1"),
    ({"step": "3"}, ValueError, r"record\['step'\]"),
    ({"step": 1, "x": object()}, TypeError, r"record\['x'\] must be JSON data"),
    ({"step": 1, "x": {2: 1}}, TypeError, "non-string key 2"),
    ([("step", 1)], TypeError, "mapping"),
  ],
)
def test_bad_record_refused(tmp_path, record, error, match):
  with MetricsWriter(tmp_path) as writer:
    with pytest.raises(error, match=match):
      writer.write(record)
  assert read_metrics(tmp_path / "metrics.jsonl") == []
  assert scalars(read_events(tmp_path / "tensorboard")) == {}


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"resume_step": -1}, "resume_step"),
    ({"resume_step": 2.0}, "resume_step"),
    ({"enabled": 1}, "enabled"),
    ({"tensorboard": "yes"}, "tensorboard"),
  ],
)
def test_bad_settings_refused(tmp_path, kwargs, match):
  with pytest.raises(ValueError, match=match):
    MetricsWriter(tmp_path, **kwargs)


@pytest.mark.parametrize("last", [True, -3, 8.0, np.float32(8), math.nan])
def test_missing_steps_refuses_a_last_step_that_is_no_step(last):
  with pytest.raises(ValueError, match=r"last must be an integer >= 0, got"):
    missing_steps([{"step": 1}], last)


def test_missing_steps_takes_numpy_integers_and_zero():
  assert missing_steps([{"step": 1}], np.int64(3)) == [[2, 3]]
  assert missing_steps([{"step": 1}], 0) == []


def test_doctests(tmp_path):
  result = doctest.testmod(metrics, extraglobs={"workdir": str(tmp_path)})
  assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- progress bar


def test_progress_bar_shows_count_and_postfix():
  out = io.StringIO()
  with ProgressBar(1000, desc="epoch 1", file=out) as bar:
    bar.update(256, loss=0.123456, batch=256, sim=np.float32(0.05))
    bar.update(300, loss=0.1, batch=300, sim=-0.0123456)
  text = out.getvalue()
  final = text.split("\r")[-1]
  assert "epoch 1" in final
  assert re.search(r"\b556(\.0)?/1(\.00k|000)\b", final), final
  assert "loss=0.1" in final and "batch=300" in final and "sim=-0.01235" in final
  assert bar.n == 556
  assert bar.postfix == {"loss": "0.1", "batch": "300", "sim": "-0.01235"}


def test_progress_bar_initial_and_postfix_kept():
  out = io.StringIO()
  with ProgressBar(100, initial=40, file=out) as bar:
    bar.update(10, loss=1.5)
    bar.update(10)  # no postfix: the last one stays
  assert bar.n == 60
  assert bar.postfix == {"loss": "1.5"}
  assert re.search(r"\b60(\.0)?/100\b", out.getvalue().split("\r")[-1])
  assert "loss=1.5" in out.getvalue().split("\r")[-1]


def test_a_progress_bar_that_does_not_stay_is_cleared_when_closed():
  out = io.StringIO()
  with ProgressBar(100, desc="evaluate", file=out, leave=False) as bar:
    bar.update(100)
  assert "evaluate" in out.getvalue()  # drawn while open
  assert "evaluate" not in out.getvalue().split("\r")[-1]  # and its line cleared at the end


def test_progress_bar_disabled_draws_nothing(capsys):
  out = io.StringIO()
  with ProgressBar(100, enabled=False, file=out) as bar:
    bar.update(30, loss=0.5, batch=30, sim=0.25)
  assert out.getvalue() == ""
  captured = capsys.readouterr()
  assert captured.err == "" and captured.out == ""
  assert bar.n == 30 and bar.postfix == {"loss": "0.5", "batch": "30", "sim": "0.25"}


def test_progress_bar_formats_compactly():
  import jax.numpy as jnp

  bar = ProgressBar(10, enabled=False)
  bar.update(
    1, a=1234567.891, b=np.int64(7), c=jnp.int32(3), d=jnp.float32(0.5), e="text", f=True, g=1e-7
  )
  assert bar.postfix == {
    "a": "1.235e+06",
    "b": "7",
    "c": "3",
    "d": "0.5",
    "e": "text",
    "f": "True",
    "g": "1e-07",
  }


@pytest.mark.parametrize(
  "args, kwargs, match",
  [
    ((-1,), {}, "total_examples"),
    ((10,), {"initial": -1}, "initial"),
    ((10.0,), {}, "total_examples"),
    ((10,), {"enabled": "no"}, "enabled"),
    ((10,), {"desc": 3}, "desc"),
  ],
)
def test_progress_bar_bad_settings(args, kwargs, match):
  with pytest.raises(ValueError, match=match):
    ProgressBar(*args, **kwargs)


def test_progress_bar_bad_update():
  bar = ProgressBar(10, enabled=False)
  with pytest.raises(ValueError, match="examples"):
    bar.update(-1)
  with pytest.raises(ValueError, match="examples"):
    bar.update(2.5)


@pytest.mark.parametrize("total", [None, 0])
def test_progress_bar_unknown_total_counts(total):
  out = io.StringIO()
  with ProgressBar(total, file=out) as bar:
    bar.update(1234, loss=0.5, batch=1234)
  final = out.getvalue().split("\r")[-1]
  assert "1.23k ex" in final and "loss=0.5, batch=1234" in final
  assert bar.n == 1234
