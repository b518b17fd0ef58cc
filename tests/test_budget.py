"""Tests for lookahead/budget.py: running acceptance rates, the per-step choice of tree size / window /
draft-chain length, and counterfactual learning."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_model

from lookahead import budget
from lookahead.budget import AcceptanceRates, StepPlanner, best_chain_length, best_row_count
from lookahead.cost_curve import CostCurve
from lookahead.drafters import DRAFT_MODEL, POOL, PROMPT, SOURCE_DRAFTER
from lookahead.tree import DraftTree

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.01, 1.02, 1.05, 1.1, 1.2), 0.05)
STEEP = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0), 0.05)
HERE = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.10, 1.69, 1.94, 2.77, 3.08, 2.91), 0.078)  # this CPU


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
