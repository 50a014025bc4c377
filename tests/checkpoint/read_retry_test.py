"""read_retry: a read that the file system failed is tried again, damage is not.

The same rules on real checkpoints (orbax's reads made to fail) are tested in
reliability/reliability_checkpoint_test.py.
"""

import doctest
import errno
import logging

import pytest

from simigrad_jax.checkpoint import read_retry


@pytest.fixture(autouse=True)
def no_waits(monkeypatch):
  waits = []
  monkeypatch.setattr(read_retry.time, "sleep", waits.append)
  return waits


def failing(errors, result="read"):
  """A read that raises ``errors`` one per call, then returns ``result``; its calls are counted."""
  calls = []

  def read():
    calls.append(len(calls))
    if len(calls) <= len(errors):
      raise errors[len(calls) - 1]
    return result

  return read, calls


@pytest.mark.parametrize(
  "error, code",
  [
    (OSError(errno.EIO, "Input/output error"), errno.EIO),
    (OSError("no errno"), errno.EIO),
    (PermissionError(errno.EACCES, "Permission denied"), errno.EACCES),
    (ValueError('UNKNOWN: reading "/c/3/d/0" failed [OS error 5: Input/output error]'), 5),
    (ValueError("tensorstore says [OS error: 28 No space left on device]"), 28),
    (FileNotFoundError(errno.ENOENT, "No such file or directory"), None),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory"), None),
    (IsADirectoryError(errno.EISDIR, "Is a directory"), None),
    (ValueError("[OS error 2: No such file or directory]"), None),
    (ValueError("the host record of step 3 fails its CRC-32 check"), None),
    (None, None),
  ],
)
def test_file_system_errno_tells_a_failed_read_from_damage(error, code):
  assert read_retry.file_system_errno(error) == code


def test_file_system_errno_looks_through_the_causes():
  try:
    try:
      raise OSError(errno.EIO, "Input/output error")
    except OSError as cause:
      raise RuntimeError("restore failed") from cause
  except RuntimeError as error:
    assert read_retry.file_system_errno(error) == errno.EIO


def test_a_failed_read_is_tried_again_with_doubling_waits(no_waits, caplog):
  read, calls = failing([OSError(errno.EIO, "Input/output error")] * 3)
  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    assert read_retry.read_with_retries(read, step=7, directory="/ckpt") == "read"
  assert len(calls) == 4
  first = read_retry.READ_RETRY_SECONDS
  assert no_waits == [first, 2 * first, 4 * first]
  assert caplog.text.count("reading the checkpoint at step 7 in /ckpt failed (OSError:") == 3


def test_a_read_that_always_fails_is_raised_as_an_oserror_naming_the_checkpoint(no_waits):
  cause = ValueError("read failed [OS error 5: Input/output error]")
  read, calls = failing([cause] * read_retry.READ_ATTEMPTS)
  with pytest.raises(OSError, match=r"step 7 in /ckpt failed 4 times .*ValueError: read") as raised:
    read_retry.read_with_retries(read, step=7, directory="/ckpt")
  assert raised.value.errno == 5 and raised.value.__cause__ is cause
  assert len(calls) == read_retry.READ_ATTEMPTS == len(no_waits) + 1


@pytest.mark.parametrize(
  "error", [ValueError("fails its CRC-32 check"), FileNotFoundError(errno.ENOENT, "gone")]
)
def test_damage_is_raised_at_once_with_its_error_as_the_cause(error, no_waits):
  read, calls = failing([error])
  with pytest.raises(read_retry.Damaged) as raised:
    read_retry.read_with_retries(read, step=7, directory="/ckpt")
  assert raised.value.__cause__ is error and len(calls) == 1 and no_waits == []


def test_errors_that_are_not_damage_pass_through_untouched(no_waits):
  class OtherModel(ValueError):
    pass

  error = OtherModel("another model")
  read, calls = failing([error])
  with pytest.raises(OtherModel) as raised:
    read_retry.read_with_retries(read, step=7, directory="/ckpt", not_damage=(OtherModel,))
  assert raised.value is error and len(calls) == 1


def test_first_line_keeps_the_first_line_and_400_characters_at_most():
  assert read_retry.first_line(ValueError("\n  one\ntwo")) == "one"
  assert read_retry.first_line(ValueError("")) == ""
  assert read_retry.first_line(ValueError("x" * 500)) == "x" * 400


def test_doctests():
  result = doctest.testmod(read_retry)
  assert result.attempted > 0 and result.failed == 0
