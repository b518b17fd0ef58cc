"""Tests for lookahead/cost_curve.py: interpolation, JSON, plausibility, the online correction."""

from __future__ import annotations

import numpy as np
import pytest

from lookahead.cost_curve import CURVE_SIZES, CostCurve, ObservedCost, implausible, interpolate


def test_cost_curve_interpolates_extrapolates_and_round_trips():
    curve = CostCurve((1, 2, 4), (1.0, 1.5, 2.5), 0.1)
    assert curve.ratio(1) == 1.0 and curve.ratio(3) == pytest.approx(2.0) and curve.ratio(6) == pytest.approx(3.5)
    assert CostCurve.from_json(curve.to_json()) == curve


# Curves found in a new user's cache after a test run on a busy machine (issue 11): never to be trusted.
POISONED = [(1.0, 16.05, 16.10, 16.10, 16.08, 16.10, 15.85, 16.10, 0.687, 0.641),
            (1.0, 3.78, 0.92, 6.60, 12.69, 13.0, 14.0, 15.0, 16.0, 17.0)]
REAL = (1.0, 1.10, 1.69, 1.94, 2.19, 2.77, 2.9, 3.08, 3.0, 2.91)  # session 1's measurement here


@pytest.mark.parametrize("ratios", POISONED)
def test_poisoned_curves_are_implausible(ratios):
    assert implausible(CostCurve(CURVE_SIZES, ratios, 0.07)) is not None


def test_a_real_curve_is_plausible():
    assert implausible(CostCurve(CURVE_SIZES, REAL, 0.07)) is None
    assert implausible(CostCurve(CURVE_SIZES, REAL, 0.07, by_context=((1024, POISONED[0]),))) is not None


def test_curve_at_a_cache_length_interpolates_between_measured_lengths():
    curve = CostCurve((1, 2, 4), (1.0, 1.2, 1.4), 0.1, 256, by_context=((1024, (1.0, 1.6, 2.2)),))
    assert curve.at(256).ratios == (1.0, 1.2, 1.4) and curve.at(100).ratios == (1.0, 1.2, 1.4)
    assert curve.at(640).ratios == pytest.approx((1.0, 1.4, 1.8)) and curve.at(4096).ratios == (1.0, 1.6, 2.2)
    assert curve.at(640).by_context == () and curve.at(640).prefix_len == 640
    assert curve.scaled(2.0).ratios == pytest.approx((1.0, 1.4, 1.8))


def test_observed_cost_corrects_the_curve_both_ways_within_bounds():
    curve = CostCurve((1, 2, 4), (1.0, 1.5, 2.0), 0.1)
    observed = ObservedCost(curve)
    assert observed.corrected(curve, 256) == curve  # nothing timed yet
    observed.record(1, 1.0)
    for _ in range(5):
        observed.record(4, 1.25)  # the machine is quieter than during the measurement: extra rows cost a quarter
    assert observed.scale() == pytest.approx(0.5)  # (0.5 + 1.25) / (0.5 + 5) clipped at the lower bound
    assert observed.corrected(curve, 256).ratio(4) == pytest.approx(1.5)
    observed.record(2, 3.0)  # one slow 2-row step barely moves the pooled estimate
    assert observed.scale() == pytest.approx((0.5 + 1.25 + 2.0) / (0.5 + 5.0 + 0.5))
    for _ in range(9):
        observed.record(2, 3.0)  # ... ten of them do
    assert observed.scale() == pytest.approx((0.5 + 1.25 + 20.0) / (0.5 + 5.0 + 5.0))


def test_observed_cost_is_not_swung_by_noise_on_a_nearly_free_row_count():
    curve = CostCurve((1, 2, 8), (1.0, 1.05, 1.5), 0.1)
    observed = ObservedCost(curve)
    observed.record(1, 1.0)
    for _ in range(3):
        observed.record(2, 1.15)  # 10% timing noise on a step predicted at +5%
    assert observed.scale() == pytest.approx((0.5 + 0.45) / (0.5 + 0.15))  # ~1.5x, where the worst-ratio rule said 3x
    for _ in range(20):
        observed.record(8, 2.5)  # wide steps really cost three times the curve's extra
    assert observed.scale() > 2.5


def test_interpolate_is_numpys_interp_to_the_bit():
    """The planner's scalar interpolation gives np.interp's very numbers, at knots, between them and beyond."""
    rng = np.random.default_rng(7)
    for _ in range(2000):
        ys = tuple(np.cumsum(rng.random(len(CURVE_SIZES))).round(4).tolist())
        for x in (float(rng.uniform(-5.0, 80.0)), int(rng.integers(0, 70)), CURVE_SIZES[int(rng.integers(0, 10))]):
            assert interpolate(x, CURVE_SIZES, ys) == float(np.interp(x, CURVE_SIZES, ys))
