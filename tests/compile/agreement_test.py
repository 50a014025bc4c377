"""The agreement on compiles across processes: a pure function of every process's report."""

import doctest

import pytest

from simigrad_jax.compile import agreement
from simigrad_jax.compile.agreement import CompileAgreement
from simigrad_jax.compile.agreement import agreed_view
from simigrad_jax.compile.agreement import report_bitmasks

GRID = [2, 4, 8, 16]


def view(fused=(), micro=(), apply=False, failed_fused=(), failed_micro=()):
  return {
    "fused": set(fused),
    "micro": set(micro),
    "apply": apply,
    "failed_fused": set(failed_fused),
    "failed_micro": set(failed_micro),
  }


def test_doctests():
  result = doctest.testmod(agreement)
  assert result.attempted > 0 and result.failed == 0


def test_every_process_agrees_on_what_all_compiled_and_any_failed():
  one = report_bitmasks(view(fused={2, 4, 8}, micro={4}, apply=True), GRID)
  two = report_bitmasks(view(fused={4, 8}, failed_fused={16}), GRID)
  assert one == {"fused": 0b0111, "micro": 0b0010, "apply": 1, "failed_fused": 0, "failed_micro": 0}
  assert agreed_view([one, two], GRID) == view(fused={4, 8}, failed_fused={16})


@pytest.mark.parametrize(
  "own",
  [
    view(),
    view(fused={2, 16}, micro={8}, apply=True),
    view(fused=GRID, micro=GRID, apply=True, failed_fused={4}, failed_micro={2, 16}),
  ],
)
def test_one_process_agrees_with_itself(own):
  assert agreed_view([report_bitmasks(own, GRID)], GRID) == own


def test_the_update_counts_only_when_every_process_compiled_it():
  reports = [report_bitmasks(view(micro={4}, apply=True), GRID) for _ in range(3)]
  assert agreed_view(reports, GRID)["apply"] is True
  reports.append(report_bitmasks(view(micro={4}), GRID))
  agreed = agreed_view(reports, GRID)
  assert agreed["apply"] is False and agreed["micro"] == {4}


def test_the_order_of_the_reports_does_not_matter():
  reports = [
    report_bitmasks(view(fused={2, 4}, failed_micro={8}), GRID),
    report_bitmasks(view(fused={4, 16}, apply=True), GRID),
    report_bitmasks(view(fused={4}, micro={2}, failed_fused={2}), GRID),
  ]
  want = view(fused={4}, failed_fused={2}, failed_micro={8})
  assert agreed_view(reports, GRID) == want
  assert agreed_view(reports[::-1], GRID) == want


def test_shapes_outside_the_grid_are_not_reported():
  assert report_bitmasks(view(fused={3, 4}), GRID)["fused"] == 0b0010


def test_no_reports_is_refused():
  with pytest.raises(ValueError, match="one report per process, got none"):
    agreed_view([], GRID)


def test_processes_that_list_the_grid_in_another_order_still_agree():
  here, there = CompileAgreement([16, 2, 8, 4]), CompileAgreement(GRID)
  reports = [here.report(view(fused={8, 16})), there.report(view(fused={8}, apply=True))]
  assert reports[0] == report_bitmasks(view(fused={8, 16}), GRID)
  here.agree(reports)
  there.agree(reports)
  assert here.view == there.view == view(fused={8})


def test_nothing_is_agreed_before_the_first_reports():
  assert CompileAgreement(GRID).view is None
