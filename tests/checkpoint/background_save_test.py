"""background_save: a failed background save is known without waiting, and raised once.

orbax's own failing saves (a full disk) are tested in
reliability/reliability_checkpoint_test.py.
"""

import doctest
import threading

import pytest

from simigrad_jax.checkpoint import background_save
from simigrad_jax.checkpoint.background_save import BackgroundSave


class FakeSave:
  """orbax's wait_until_finished: blocks until released, then raises ``error`` (if any) in every
  thread that waits, as orbax does."""

  def __init__(self, error=None):
    self.error, self.released, self.waits = error, threading.Event(), 0

  def wait_until_finished(self):
    self.waits += 1
    assert self.released.wait(timeout=30)
    if self.error is not None:
      raise self.error


def test_no_save_is_nothing_to_wait_for_or_report():
  save = BackgroundSave(FakeSave().wait_until_finished)
  assert save.wait(timeout=0) is True and save.failed() is None


def test_a_save_under_way_is_neither_finished_nor_failed():
  fake = FakeSave(OSError("No space left on device"))
  save = BackgroundSave(fake.wait_until_finished)
  save.started()
  assert save.failed() is None and save.wait(timeout=0.01) is False
  fake.released.set()
  with pytest.raises(OSError, match="No space left"):
    save.wait()


def test_a_finished_save_is_waited_for_once():
  save, fake = finished_save()
  assert save.wait(timeout=30) is True and save.failed() is None
  assert save.wait(timeout=0) is True and fake.waits == 1


def reported(save):
  """Polls ``save.failed()`` until the helper thread has settled the save's failure."""
  for _ in range(3000):
    error = save.failed()
    if error is not None:
      return error
    threading.Event().wait(0.01)
  raise AssertionError("the failed save was not reported within 30 s")


def finished_save(error=None):
  """A save started and finished (failed with ``error``), and its fake orbax."""
  fake = FakeSave(error)
  fake.released.set()
  save = BackgroundSave(fake.wait_until_finished)
  save.started()
  return save, fake


def test_a_failed_save_is_reported_without_waiting_and_not_raised_again():
  error = OSError("No space left on device")
  save, fake = finished_save(error)
  assert reported(save) is error
  assert fake.waits == 2  # the helper thread's wait, and this thread's turn taken
  assert save.wait(timeout=30) is True  # handed over once: not raised again
  assert save.wait(timeout=0) is True and save.failed() is None


def test_a_failed_save_not_reported_is_raised_by_the_wait_once():
  error = OSError("No space left on device")
  save, _ = finished_save(error)
  with pytest.raises(OSError) as raised:
    save.wait(timeout=30)
  assert raised.value is error
  assert save.wait(timeout=0) is True


def test_another_error_of_the_turn_taken_is_raised():
  first, second = OSError("disk full"), RuntimeError("orbax broke")
  errors = [first, second]
  gate = threading.Event()

  def wait_until_finished():
    assert gate.wait(timeout=30)
    raise errors.pop(0)

  save = BackgroundSave(wait_until_finished)
  save.started()
  gate.set()
  with pytest.raises(RuntimeError, match="orbax broke"):
    reported(save)


def test_doctests():
  result = doctest.testmod(background_save)
  assert result.attempted > 0 and result.failed == 0
