"""Tests for lookahead/budget.py: the cost curve (interpolation, JSON, measuring, disk cache), running
acceptance rates, the per-step choice of tree size / window / draft-chain length, and counterfactual learning."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_model

from lookahead import budget
from lookahead.budget import (AcceptanceRates, CostCurve, StepPlanner, best_chain_length, best_row_count,
                              cost_curve_for, measure_cost_curve)
from lookahead.drafters import DRAFT_MODEL, POOL, PROMPT, SOURCE_DRAFTER
from lookahead.tree import DraftTree

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.01, 1.02, 1.05, 1.1, 1.2), 0.05)
STEEP = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0), 0.05)
HERE = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.10, 1.69, 1.94, 2.77, 3.08, 2.91), 0.078)  # this CPU


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
    monkeypatch.setattr(budget, "_MEMORY", {})
    calls = []
    monkeypatch.setattr(budget, "measure_cost_curve", lambda model, sizes, batch: calls.append(batch) or FLAT)
    model = build_tiny_model("llama")
    assert cost_curve_for(model, quiet=True) == FLAT and len(calls) == 1
    assert cost_curve_for(model, quiet=True) == FLAT and len(calls) == 1  # memory
    monkeypatch.setattr(budget, "_MEMORY", {})
    assert cost_curve_for(model, quiet=True) == FLAT and len(calls) == 1  # disk
    assert len(list((tmp_path / "cost").glob("*.json"))) == 1
    cost_curve_for(model, refresh=True, quiet=True)
    cost_curve_for(model, quiet=True, batch=4)  # another batch size: its own curve and file
    assert calls == [1, 1, 4] and len(list((tmp_path / "cost").glob("*.json"))) == 2


def test_acceptance_rates_follow_the_counts_with_decay():
    rates = AcceptanceRates(2, prior=0.3, decay=0.5)
    assert rates.rates() == pytest.approx([0.3, 0.3])
    for _ in range(20):
        rates.update(np.array([4.0, 4.0]), np.array([4.0, 0.0]))
    assert rates.rates()[0] > 0.95 and rates.rates()[1] < 0.05


def test_best_row_count_follows_the_curve():
    scores = np.array([0.9, 0.8, 0.7, 0.5, 0.2, 0.1])
    assert best_row_count(scores, 0, 0.0, FLAT) == (6, False)  # rows are free: verify everything
    assert best_row_count(scores, 0, 0.0, STEEP) == (0, False)  # every row costs a full step: never
    k, _ = best_row_count(scores, 0, 0.0, HERE)
    assert 0 < k < 6  # this CPU: only the confident nodes
    assert best_row_count(np.array([0.05, 0.05]), 4, 2.0, FLAT) == (2, True)  # a valuable window runs


def test_best_chain_length_grows_with_acceptance_and_shrinks_with_draft_cost():
    assert best_chain_length(0.95, 6, 0.05, FLAT) == 6
    assert best_chain_length(0.1, 6, 0.05, FLAT) <= 1
    assert best_chain_length(0.9, 6, 1.0, FLAT) < best_chain_length(0.9, 6, 0.05, FLAT)
    assert best_chain_length(0.3, 4, 0.4, HERE) == 0  # a weak, costly draft rests


def test_chain_length_rests_but_probes():
    planner = StepPlanner(HERE, len(SOURCE_DRAFTER), 0)
    planner.rates.accepted[DRAFT_MODEL] = 0.0
    assert planner.chain_length(DRAFT_MODEL, None, 4) == 4  # speed unknown yet: try the full chain
    lengths = []
    for _ in range(2 * budget.PROBE_EVERY):
        lengths.append(planner.chain_length(DRAFT_MODEL, 0.05, 4))
        planner.steps += 1
    assert lengths.count(1) == 2 and set(lengths) == {0, 1}
    assert StepPlanner(None, len(SOURCE_DRAFTER), 0).chain_length(DRAFT_MODEL, 0.05, 4) == 4


def test_planner_learns_from_pruned_nodes_too():
    planner = StepPlanner(STEEP, len(SOURCE_DRAFTER), 0)
    tree = DraftTree.from_paths(7, [[1, 2, 3], [4]], [PROMPT, POOL], budget=16)
    pruned, use_window = planner.plan(tree)
    assert pruned.size == 1 and not use_window  # nothing is worth verifying on a steep curve
    before = planner.rates.rates().copy()
    for _ in range(10):
        planner.learn(tree, [1, 2, 3, 9], used_window=False, pool_source=POOL)
    after = planner.rates.rates()
    assert after[PROMPT] > before[PROMPT] and after[POOL] < before[POOL]
    assert planner.steps == 10
