"""Tests for lookahead/cost_curve.py: interpolation, JSON, measuring, the disk cache, robustness."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model

from lookahead import cost_curve
from lookahead.cost_curve import CostCurve, cost_curve_for, measure_cost_curve

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.01, 1.02, 1.05, 1.1, 1.2), 0.05)


def test_cost_curve_interpolates_extrapolates_and_round_trips():
    curve = CostCurve((1, 2, 4), (1.0, 1.5, 2.5), 0.1)
    assert curve.ratio(1) == 1.0 and curve.ratio(3) == pytest.approx(2.0) and curve.ratio(6) == pytest.approx(3.5)
    assert CostCurve.from_json(curve.to_json()) == curve


def test_measure_cost_curve_on_a_tiny_model():
    model = build_tiny_model("llama", dtype=torch.float32)
    curve = measure_cost_curve(model, sizes=(1, 2, 4), prefix_len=16, repeats=2)
    assert curve.sizes == (1, 2, 4) and curve.ratios[0] == 1.0 and curve.base_seconds > 0
    assert all(r > 0 for r in curve.ratios) and curve.prefix_len == 16


def test_cost_curve_for_caches_on_disk_and_in_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_curve, "_MEMORY", {})
    calls = []
    monkeypatch.setattr(cost_curve, "measure_cost_curve", lambda model, sizes, batch: calls.append(batch) or FLAT)
    model = build_tiny_model("llama")
    assert cost_curve_for(model, quiet=True) == FLAT and len(calls) == 1
    assert cost_curve_for(model, quiet=True) == FLAT and len(calls) == 1  # memory
    monkeypatch.setattr(cost_curve, "_MEMORY", {})
    assert cost_curve_for(model, quiet=True) == FLAT and len(calls) == 1  # disk
    assert len(list((tmp_path / "cost").glob("*.json"))) == 1
    cost_curve_for(model, refresh=True, quiet=True)
    cost_curve_for(model, quiet=True, batch=4)  # another batch size: its own curve and file
    assert calls == [1, 1, 4] and len(list((tmp_path / "cost").glob("*.json"))) == 2
