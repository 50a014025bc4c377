"""process_agreement with one process: the report is returned, an oversized one refused.

The exchange between processes is tested with 2 real processes in
reliability_multihost_test.py and reliability_multihost_fallback_test.py.
"""

import pytest

from simigrad_jax.runtime import process_agreement


def test_one_process_gets_its_own_report_back_and_compares_nothing():
  assert process_agreement.agree("decision", {"batch_size": 48}) is None
  assert process_agreement.agree("decision", {"batch_size": 48},
                                 report={"fused": 5, "apply": 1}) == [{"fused": 5, "apply": 1}]


def test_a_report_longer_than_the_exchange_sends_is_refused():
  with pytest.raises(ValueError, match="a report of 5[0-9][0-9] bytes does not fit the 512 bytes"):
    process_agreement.agree("decision", {}, report={"sizes": "x" * 500})
