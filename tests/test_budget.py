"""Tests for lookahead/budget.py: running acceptance rates, the per-step choice of tree size / window /
draft-chain length, and counterfactual learning."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_model

from lookahead import budget
from lookahead.budget import AcceptanceRates, StepPlanner, best_chain_length, best_row_count
from lookahead.cost_curve import CostCurve, ObservedCost
from lookahead.drafters import DRAFT_MODEL, POOL, PROMPT, SOURCE_DRAFTER
from lookahead.tree import DraftTree

RECORD = budget.BatchPlanner.record  # as imported, before conftest's fixture wraps it
FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.01, 1.02, 1.05, 1.1, 1.2), 0.05)
STEEP = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0), 0.05)
HERE = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.10, 1.69, 1.94, 2.77, 3.08, 2.91), 0.078)  # this CPU


def test_acceptance_rates_follow_the_counts_per_source_and_depth_with_decay():
    rates = AcceptanceRates(2, prior=0.3, decay=0.5, depths=3)
    assert rates.rates() == pytest.approx(np.full((2, 3), 0.3))
    tested, accepted = np.full((2, 3), 4.0), np.zeros((2, 3))
    accepted[0] = 4.0
    accepted[1, 2] = 4.0
    for _ in range(20):
        rates.update(tested, accepted)
    assert (rates.rates()[0] > 0.95).all() and (rates.rates()[1, :2] < 0.05).all() and rates.rates()[1, 2] > 0.95
    before = rates.rates().copy()
    rates.update(np.zeros((2, 3)), np.zeros((2, 3)))  # an untested cell keeps its estimate
    assert rates.rates() == pytest.approx(before)


def test_a_depth_not_tested_yet_starts_from_the_shallower_estimate():
    rates = AcceptanceRates(2, prior=0.3, decay=0.9, depths=4)
    tested, accepted = np.zeros((2, 4)), np.zeros((2, 4))
    tested[0, :2], accepted[0, :2] = 10.0, 9.0  # source 0 reached depth 2 and was nearly always right
    tested[1, 0] = 10.0  # source 1 was always wrong at depth 1
    for _ in range(5):
        rates.update(tested, accepted)
    got = rates.rates()
    assert got[0, 2] == pytest.approx(got[0, 1]) and got[0, 3] == pytest.approx(got[0, 1]) and got[0, 1] > 0.85
    assert got[1, 1] == pytest.approx(got[1, 0]) and got[1, 0] < 0.05  # not the fixed prior 0.3


def _reference_estimates(rates: AcceptanceRates) -> np.ndarray:
    """The class docstring's rule, one numpy expression per depth (what `_estimate` computed before it was compiled)."""
    out = np.empty_like(rates.accepted)
    above = np.full(out.shape[0], rates.prior)
    for d in range(out.shape[1]):
        total = rates.tested[:, d] + rates.prior_weight
        estimate = (rates.accepted[:, d] + rates.prior_weight * above) / np.maximum(total, 1e-300)
        above = out[:, d] = np.where(total > 1e-12, estimate, above)
    return np.clip(out, 0.01, 0.99)


def test_compiled_estimates_are_the_reference_rule_to_the_bit():
    rng = np.random.default_rng(0)
    for case in range(300):
        rates = AcceptanceRates(7, prior=float(rng.uniform(0.05, 0.6)))
        rates.tested = rng.random((7, 8)) * rng.integers(0, 6) * (rng.random((7, 8)) < 0.6)
        rates.accepted = rates.tested * rng.random((7, 8))
        rates.prior_weight = (2.0, 1e-13, 0.0, float(rng.uniform(0, 2)))[case % 4]  # incl. no prior weight left
        assert np.array_equal(rates._estimate(), _reference_estimates(rates)), case


def _rates(n_sources: int, depths: int, value: float) -> np.ndarray:
    return np.full((n_sources, depths), value)


def test_path_values_multiply_conditional_rates_along_the_path():
    # root 7 -> 1 -> 2 -> 3 (source 0) and root -> 4 (source 1)
    tree = DraftTree.from_paths(7, [[1, 2, 3], [4]], [0, 1], budget=16)
    rates = np.array([[0.5, 0.8, 0.9], [0.2, 0.2, 0.2]])
    values = budget.path_values(tree, rates)
    by_token = {int(t): v for t, v in zip(tree.tokens, values)}
    assert by_token[7] == 1.0
    assert by_token[1] == pytest.approx(0.5) and by_token[4] == pytest.approx(0.2)
    assert by_token[2] == pytest.approx(0.5 * 0.8) and by_token[3] == pytest.approx(0.5 * 0.8 * 0.9)
    deep = DraftTree.from_paths(7, [list(range(1, 7))], [0], budget=16)  # deeper than the table: last column
    assert budget.path_values(deep, rates)[-1] == pytest.approx(0.5 * 0.8 * 0.9**4)


def test_siblings_exclude_each_other():
    """Five children each estimated at 0.6: at most one is accepted, so together they are worth < 1 token."""
    tree = DraftTree.from_paths(0, [[t] for t in range(1, 6)], [0] * 5, budget=16)
    values = budget.path_values(tree, _rates(1, 2, 0.6))
    assert values[1:].sum() == pytest.approx(budget.SIBLING_CAP)
    assert budget.path_values(tree, _rates(1, 2, 0.1))[1:].sum() == pytest.approx(0.5)  # below the cap: as is


def test_rank_prunes_by_estimate_not_by_draft_order():
    planner = StepPlanner(None, len(SOURCE_DRAFTER), 0)
    planner.rates.tested[:] = 100.0
    planner.rates.accepted[:] = 5.0
    planner.rates.accepted[POOL] = 90.0  # the pool is the reliable drafter here
    planner.rates.prior_weight = 0.0  # the counts alone
    tree = DraftTree.from_paths(7, [[1, 2, 3], [4, 5]], [PROMPT, POOL], budget=16)
    kept = planner.rank(tree).prune(2)
    assert kept.tokens.tolist() == [7, 4, 5]
    assert budget.expected_tokens(kept) == pytest.approx(1 + 0.9 + 0.81)
    assert planner.node_scores(tree) == pytest.approx(sorted(budget.path_values(tree, planner.rates.rates())[1:],
                                                             reverse=True))


def test_planner_predictions_are_calibrated_on_a_synthetic_verifier():
    """The text continues the prompt-lookup draft with probability 0.7 (then each further token with 0.9), the
    first pool draft with 0.2 (then 0.5), the second pool draft never. After learning, the predicted tokens per
    step match the committed ones, although the two pool siblings share one estimate."""
    rng = np.random.default_rng(0)
    paths = [[1, 2, 3, 4], [5, 6], [8, 9]]
    tree = DraftTree.from_paths(0, paths, [PROMPT, POOL, POOL], budget=16)
    planner = StepPlanner(FLAT, len(SOURCE_DRAFTER), 0)
    predicted, observed = [], []
    for step in range(1500):
        first = rng.random()
        chosen, follow = (paths[0], 0.9) if first < 0.7 else (paths[1], 0.5) if first < 0.9 else ([], 0.0)
        tokens = chosen[:1]
        for token in chosen[1:]:
            if rng.random() >= follow:
                break
            tokens.append(token)
        tokens.append(99)  # the bonus
        if step >= 300:
            predicted.append(budget.expected_tokens(planner.rank(tree)))
            observed.append(len(tokens))
        planner.learn(tree, tokens, used_window=False, pool_source=POOL)
    truth = 1 + 0.7 * (1 + 0.9 + 0.81 + 0.729) + 0.2 * 1.5
    assert np.mean(observed) == pytest.approx(truth, rel=0.05)
    assert np.mean(predicted) == pytest.approx(np.mean(observed), rel=0.05)


def test_best_row_count_follows_the_curve():
    scores = np.array([0.9, 0.8, 0.7, 0.5, 0.2, 0.1])
    assert best_row_count(scores, 0, 0.0, FLAT) == (6, False)  # rows are free: verify everything
    assert best_row_count(scores, 0, 0.0, STEEP) == (0, False)  # every row costs a full step: never
    k, _ = best_row_count(scores, 0, 0.0, HERE)
    assert 0 < k < 6  # this CPU: only the confident nodes
    assert best_row_count(np.array([0.05, 0.05]), 4, 2.0, FLAT) == (2, True)  # a valuable window runs


def test_best_chain_length_grows_with_acceptance_and_shrinks_with_draft_cost():
    assert best_chain_length(0.95, 6, 0.05, FLAT) == 6
    assert best_chain_length(np.array([0.95, 0.95, 0.02]), 6, 0.05, HERE) == 2  # per depth: stop before depth 3
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
    assert after[PROMPT, 0] > before[PROMPT, 0] and after[PROMPT, 2] > before[PROMPT, 2]
    assert after[POOL, 0] < before[POOL, 0]
    assert planner.rates.tested[POOL, 1] == 0 and after[POOL, 1] == pytest.approx(after[POOL, 0])  # a one-token path
    assert planner.steps == 10


def test_stats_record_the_planners_prediction_for_every_step():
    from lookahead import Lookahead
    from tiny_models import repetitive_prompt

    model = build_tiny_model("llama", dtype=torch.float64, seed=1)
    decoder = Lookahead(tree_budget=8)
    model.generate(repetitive_prompt(0), do_sample=False, max_new_tokens=32, custom_generate=decoder)
    stats = decoder.last_stats
    assert len(stats.calibration) == stats.steps
    assert Counter(n for _, n in stats.calibration) == stats.tokens_per_step
    assert all(e >= 1.0 for e, _ in stats.calibration)
    assert stats.as_dict()["mean_expected_tokens"] == pytest.approx(stats.mean_expected_tokens)


def test_batch_planner_takes_a_plain_step_after_the_cold_ones_unless_the_draws_follow_the_plan():
    tree = DraftTree.from_paths(1, [[2, 3, 4], [5, 6]], [PROMPT, POOL], budget=8)
    planner = StepPlanner(FLAT, len(SOURCE_DRAFTER), 0)
    planner.rates.tested[:], planner.rates.accepted[:] = 100.0, 90.0
    timed = budget.BatchPlanner(FLAT, None, 1, draws_follow_plan=False)
    for _ in range(budget.COLD_FORWARDS):  # the first steps: on the measured curve, their slow times not recorded
        assert timed.plan([planner], [tree], 256)[0][0].size == tree.size
        timed.record(tree.size, 0.5)
    assert [(t.size, w) for t, w in timed.plan([planner], [tree], 256)] == [(1, False)]  # the reference time
    timed.record(1, 0.05)
    assert timed.plan([planner], [tree], 256)[0][0].size == tree.size
    untimed = budget.BatchPlanner(FLAT, None, 1, draws_follow_plan=True)  # random draws must not follow timings
    assert untimed.plan([planner], [tree], 256)[0][0].size == tree.size
    batch = budget.BatchPlanner(FLAT, FLAT, 2, draws_follow_plan=True)  # batches are always timed
    for _ in range(budget.COLD_FORWARDS):
        batch.record(1, 0.5)
    assert [t.size for t, _ in batch.plan([planner] * 2, [tree] * 2, 256)] == [1, 1]
    assert budget.BatchPlanner(None, None, 1, False).plan([StepPlanner(None, len(SOURCE_DRAFTER), 0)], [tree],
                                                          256)[0][0].size == tree.size


def test_the_cold_forwards_after_the_prefill_are_not_the_reference_time(monkeypatch):
    """The first forwards after the prefill run slow: were one the plain reference, later multi-row steps would
    look cheaper than one row and the correction would sit at its floor."""
    monkeypatch.setattr(budget.BatchPlanner, "record", RECORD)  # real seconds (conftest times steps by the curve)
    timed = budget.BatchPlanner(FLAT, None, 1, draws_follow_plan=False)
    for seconds in (0.110, 0.086, 0.076)[: budget.COLD_FORWARDS]:
        timed.record(1, seconds)
    timed.record(1, 0.055)
    for _ in range(5):
        timed.record(4, 0.077)  # +40% over a warm one-row step
    assert timed.observed.plain_seconds == pytest.approx(0.055)
    expected = (0.5 + 5 * (0.077 / 0.055 - 1)) / (0.5 + 5 * (FLAT.ratio(4) - 1))
    assert timed.observed.scale() == pytest.approx(min(expected, ObservedCost.SCALE_RANGE[1]))
