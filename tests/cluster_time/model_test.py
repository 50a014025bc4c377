"""simigrad_jax.cluster_time.model: the step-time arithmetic against hand-computed cases."""

import math

import numpy as np
import pytest

from simigrad_jax.cluster_time import DeviceCurve
from simigrad_jax.cluster_time import Link
from simigrad_jax.cluster_time import StepTimeModel
from simigrad_jax.cluster_time.model import CpuStepModel
from simigrad_jax.cluster_time.model import fit_cpu_model
from simigrad_jax.cluster_time.model import ring_allreduce_seconds


def test_a_ring_all_reduce_moves_2_n_minus_1_over_n_of_the_bytes_in_2_n_minus_1_steps():
  link = Link(bandwidth=1e9, latency=1e-5)
  # 8 devices, 4 MB: 2*7/8 * 4e6 / 1e9 = 7 ms of bandwidth, 14 steps of 10 us = 0.14 ms.
  assert ring_allreduce_seconds(4e6, 8, link) == pytest.approx(7e-3 + 1.4e-4)
  assert ring_allreduce_seconds(4e6, 2, link) == pytest.approx(4e-3 + 2e-5)
  assert ring_allreduce_seconds(4e6, 1, link) == 0.0
  # The bandwidth term approaches 2 x bytes / bandwidth; the latency term grows with N.
  assert ring_allreduce_seconds(4e6, 1024, Link(1e9, 0.0)) == pytest.approx(2 * 1023 / 1024 * 4e-3)


@pytest.mark.parametrize("devices", [0, -1, True, 16.5, math.inf])
def test_a_ring_or_step_of_no_whole_device_count_is_refused(devices):
  model = StepTimeModel(DeviceCurve(1e-3, 1e-5), 1e6)
  with pytest.raises(ValueError, match=r"devices must be an integer >= 1, got "):
    ring_allreduce_seconds(1.0, devices, Link(1e9, 0.0))
  with pytest.raises(ValueError, match=r"devices must be an integer >= 1, got "):
    model.seconds(64, devices, Link(1e9, 0.0))


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda: Link(0, 0.0), r"Link.bandwidth must be a number in \(0, inf\) \(finite\), got 0"),
    (lambda: Link(-1e9, 0.0), r"Link.bandwidth must be .*, got -1000000000.0"),
    (lambda: Link(math.inf, 0.0), r"Link.bandwidth must be .*, got inf"),
    (lambda: Link(1e9, -1e-5), r"Link.latency must be a number in \[0, inf\) \(finite\)"),
    (lambda: DeviceCurve(-1e-3, 1e-5), r"DeviceCurve.overhead_s must be .*, got -0.001"),
    (lambda: DeviceCurve(1e-3, math.nan), r"DeviceCurve.seconds_per_example must be .*, got nan"),
    (lambda: DeviceCurve(0, 0, "x", -1.0), r"DeviceCurve.seconds_per_example_squared must be"),
    (lambda: StepTimeModel(DeviceCurve(0, 0), -1e6), r"StepTimeModel.gradient_bytes must be"),
    (lambda: StepTimeModel(DeviceCurve(0, 0), 1e6, True), r"StepTimeModel.host_s must be"),
  ],
)
def test_a_figure_out_of_its_range_is_refused_naming_it(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_numpy_figures_give_python_floats():
  model = StepTimeModel(DeviceCurve(np.float64(2e-3), np.float32(1e-4)), np.int64(10**6))
  link = Link(np.float64(1e9), np.float64(1e-5))
  assert type(model.host_s) is float and type(link.bandwidth) is float
  seconds = model.seconds(256, np.int64(8), link)
  assert type(seconds) is float
  assert seconds == pytest.approx(StepTimeModel(DeviceCurve(2e-3, 1e-4), 1e6).seconds(256, 8, link))


def test_a_step_is_host_plus_one_devices_rows_plus_the_all_reduce():
  model = StepTimeModel(DeviceCurve(2e-3, 1e-4), gradient_bytes=1e6, host_s=5e-4)
  link = Link(1e9, 1e-5)
  # 256 examples on 8 devices: 32 rows each: 2 + 3.2 ms; the ring: 1.75 ms + 0.14 ms.
  assert model.seconds(256, 8, link) == pytest.approx(5e-4 + 5.2e-3 + 1.75e-3 + 1.4e-4)
  # A batch smaller than the devices still costs each device a (padded) row.
  assert model.seconds(16, 64, link) == pytest.approx(
    5e-4 + 2.1e-3 + ring_allreduce_seconds(1e6, 64, link)
  )
  # A batch the devices do not divide is padded up: 100 on 8 is 13 rows each.
  assert model.seconds(100, 8, link) - model.seconds(96, 8, link) == pytest.approx(1e-4)


def test_a_device_from_its_flops():
  curve = DeviceCurve.from_flops(4e7, 400e12, 0.25, 5e-4, "preset")
  assert curve.seconds_per_example == pytest.approx(4e-7)
  assert curve.seconds(1000) == pytest.approx(5e-4 + 4e-4)


def test_the_cpu_model_serialises_the_devices_over_the_cores():
  model = CpuStepModel(overhead_s=1e-3, seconds_per_example=1e-4, collective_s=5e-4, cores=2)
  # 1 device: 1 + 6.4 ms; 8 devices on 2 cores: (8 x 1 + 6.4) / 2 + 7 x 0.5 = 10.7 ms.
  assert model.seconds(64, 1, host_s=1e-3) == pytest.approx(1e-3 + 7.4e-3)
  assert model.seconds(64, 8, host_s=0.0) == pytest.approx(7.2e-3 + 3.5e-3)
  assert model.device_curve().seconds(32) == pytest.approx(4.2e-3)


def test_the_fit_recovers_the_model_that_made_the_points_and_predicts_others():
  truth = CpuStepModel(2e-3, 3e-5, 1e-3, cores=2, launch_s=5e-4, device_parallelism=1.75)
  points = [(n, b, truth.seconds(b, n, 4e-4), 4e-4) for n in (1, 2, 4, 8) for b in (32, 512)]
  fit = fit_cpu_model(points, cores=2)
  assert fit.device_parallelism == 1.75
  assert (fit.overhead_s, fit.seconds_per_example, fit.collective_s, fit.launch_s) == (
    pytest.approx((2e-3, 3e-5, 1e-3, 5e-4))
  )
  # A batch between the fitted ones.
  assert fit.seconds(128, 4, 4e-4) == pytest.approx(truth.seconds(128, 4, 4e-4))


def test_one_device_spreads_its_examples_over_its_parallelism():
  model = CpuStepModel(0.0, 1e-4, 0.0, cores=2, device_parallelism=1.5)
  # One device alone: 64 examples at 0.1 ms; two devices go 2 / 1.5 times as fast, not 2.
  assert model.seconds(64, 1, host_s=0.0) == pytest.approx(6.4e-3)
  assert model.seconds(64, 2, host_s=0.0) == pytest.approx(6.4e-3 * 1.5 / 2)
  assert model.seconds(64, 8, host_s=0.0) == pytest.approx(6.4e-3 * 1.5 / 2)
  # The launch is paid once a step whatever the devices; a device's overhead once a device.
  model = CpuStepModel(1e-3, 0.0, 0.0, cores=2, launch_s=2e-3)
  assert model.seconds(64, 1, 0.0) == pytest.approx(3e-3)
  assert model.seconds(64, 8, 0.0) == pytest.approx(2e-3 + 8 * 1e-3 / 2)
  assert model.device_curve().seconds(10) == pytest.approx(3e-3)


def test_a_parallelism_outside_the_cores_is_refused():
  points = [(n, 8, 1e-3 * n, 0.0) for n in (1, 2, 4, 8, 16)]
  with pytest.raises(ValueError, match="device_parallelism must be from 1 to cores=2, got 3"):
    fit_cpu_model(points, cores=2, device_parallelism=3)


def test_a_term_the_points_do_not_support_is_held_at_zero():
  # Step times that fall with the devices: no collective cost to fit, and none negative.
  points = [(n, b, b * 1e-4 / min(n, 2), 0.0) for n in (1, 2, 4, 8) for b in (64, 128)]
  fit = fit_cpu_model(points, cores=2)
  assert fit.collective_s >= 0 and fit.overhead_s >= 0 and fit.seconds_per_example >= 0
  assert not math.isnan(fit.seconds(64, 8, 0.0))
  assert fit.collective_s == pytest.approx(0.0, abs=1e-12)
  assert fit.seconds_per_example == pytest.approx(1e-4)


def test_the_fit_needs_as_many_points_as_parameters():
  with pytest.raises(ValueError, match="at least 5 points, got 4"):
    fit_cpu_model([(n, 8, 1.0, 0.0) for n in (1, 2, 4, 8)], cores=2)


def test_an_examples_cost_that_grows_with_the_rows_is_the_square_term():
  curve = DeviceCurve(1e-3, 1e-4, "measured", seconds_per_example_squared=1e-6)
  # 100 rows: 1 + 10 + 10 ms.
  assert curve.seconds(100) == pytest.approx(21e-3)
  truth = CpuStepModel(1e-3, 1e-4, 5e-4, cores=1, seconds_per_example_squared=1e-6)
  # 4 devices on one core, 128 examples: 4 x (1 + 3.2 + 1.024) ms + 3 x 0.5 ms.
  assert truth.seconds(128, 4, 0.0) == pytest.approx(4 * 5.224e-3 + 1.5e-3)
  points = [(n, b, truth.seconds(b, n, 0.0), 0.0) for n in (1, 2, 4, 8) for b in (16, 64, 128)]
  fit = fit_cpu_model(points, cores=1)
  assert fit.seconds_per_example_squared == pytest.approx(1e-6)
  assert fit.device_curve().seconds(50) == pytest.approx(1e-3 + 5e-3 + 2.5e-3)
