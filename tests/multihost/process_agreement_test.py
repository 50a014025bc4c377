"""process_agreement with one process: nothing is compared or exchanged, an oversized report refused.

The exchange between processes is tested with 2 real processes in
reliability_multihost_test.py and reliability_multihost_fallback_test.py.
"""

import doctest
import threading

import pytest

from simigrad_jax.multihost import process_agreement
from simigrad_jax.multihost.process_agreement import ProcessAgreement


def test_one_process_gets_its_own_report_back_and_compares_nothing():
  assert process_agreement.agree("decision", {"batch_size": 48}) is None
  assert process_agreement.agree(
    "decision", {"batch_size": 48}, report={"fused": 5, "apply": 1}
  ) == [{"fused": 5, "apply": 1}]


def test_a_report_longer_than_the_exchange_sends_is_refused():
  with pytest.raises(ValueError, match="a report of 5[0-9][0-9] bytes does not fit the 512 bytes"):
    process_agreement.agree("decision", {}, report={"sizes": "x" * 500})


def test_the_agreement_of_one_process_is_a_no_op(monkeypatch):
  def no_exchange(*args, **kwargs):
    raise AssertionError("one process exchanged values")

  monkeypatch.setattr(process_agreement, "_gather_texts", no_exchange)
  agreement = ProcessAgreement(timeout=0.5)
  assert agreement.num_processes == 1 and agreement.timeout == 0.5
  assert agreement.agree("settings", {"seed": 3}, set_up=True) is None
  assert agreement.agree("decision of step 1", {"batch_size": 48}, report=[1, 2]) == [[1, 2]]
  assert agreement.gather("checkpoint saved", False) == [False]
  assert agreement.roll_call("step 2", RuntimeError("Connection reset by peer")) is None
  agreement.start_watchdog()
  assert not [t for t in threading.enumerate() if t.name == "simigrad-watchdog"]
  assert agreement.lost_processes() == frozenset()
  agreement.close()
  agreement.close()  # twice is fine


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan"), "300"])
def test_a_bad_timeout_is_refused_naming_it(timeout):
  with pytest.raises(ValueError, match=r"timeout must be a number in \(0, inf\) \(finite\)"):
    ProcessAgreement(timeout)


def test_doctests():
  assert doctest.testmod(process_agreement).failed == 0
