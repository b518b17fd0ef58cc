"""Tests for lookahead/jacobi.py: the window's mask and offsets (literal table and properties), `advance` on
hand-built windows, n-gram harvesting, reset."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.jacobi import JacobiWindow


def window_with(tokens, seed=0) -> JacobiWindow:
    """A window holding the given [L, W] tokens, as if it had been reset and then iterated."""
    tokens = np.asarray(tokens, dtype=np.int64)
    window = JacobiWindow(tokens.shape[0], tokens.shape[1], seed)
    window.reset(tokens.reshape(-1))
    window.tokens[:] = tokens
    return window


def test_mask_and_offsets_literal_2x3():
    window = JacobiWindow(2, 3)
    # rows/cols in level-major order: (0,0) (0,1) (0,2) (1,0) (1,1) (1,2)
    expected = np.array([
        [1, 0, 0, 0, 0, 0],  # (0,0): itself
        [1, 1, 0, 0, 0, 0],  # (0,1): (0,0..1)
        [1, 1, 1, 0, 0, 0],  # (0,2): (0,0..2)
        [1, 0, 0, 1, 0, 0],  # (1,0): (0,0), (1,0)
        [1, 1, 0, 0, 1, 0],  # (1,1): (0,0..1), (1,1)
        [1, 1, 1, 0, 0, 1],  # (1,2): (0,0..2), (1,2)
    ], dtype=bool)  # fmt: skip
    np.testing.assert_array_equal(window.mask, expected)
    assert window.offsets.tolist() == [1, 2, 3, 2, 3, 4]
    assert window.offsets.dtype == np.int64
    assert window.size == 6


def test_mask_literal_3x2():
    window = JacobiWindow(3, 2)
    expected = np.array([
        [1, 0, 0, 0, 0, 0],  # (0,0)
        [1, 1, 0, 0, 0, 0],  # (0,1)
        [1, 0, 1, 0, 0, 0],  # (1,0)
        [1, 1, 0, 1, 0, 0],  # (1,1)
        [1, 0, 1, 0, 1, 0],  # (2,0)
        [1, 1, 0, 1, 0, 1],  # (2,1)
    ], dtype=bool)  # fmt: skip
    np.testing.assert_array_equal(window.mask, expected)
    assert window.offsets.tolist() == [1, 2, 2, 3, 3, 4]


@settings(max_examples=60, deadline=None)
@given(levels=st.integers(1, 6), columns=st.integers(1, 6))
def test_each_row_conditions_on_a_gapless_sequence(levels, columns):
    """Row r sits at offset o(r); what it sees inside the window must be one cell at each offset 1..o(r)
    (after the root at offset 0): exactly the sequence a token at that position conditions on."""
    window = JacobiWindow(levels, columns)
    mask, offsets = window.mask, window.offsets
    assert mask.shape == (levels * columns, levels * columns)
    for row in range(window.size):
        level, column = divmod(row, columns)
        assert offsets[row] == 1 + column + level
        seen = np.flatnonzero(mask[row])
        assert mask[row, row]
        assert len(seen) == offsets[row]
        assert sorted(offsets[seen].tolist()) == list(range(1, offsets[row] + 1))
        # brute force of the documented rule: (0, 0..j) and (1..l, j)
        rule = {c for c in range(column + 1)} | {lv * columns + column for lv in range(1, level + 1)}
        assert set(seen.tolist()) == rule


def test_flat_tokens_is_level_major():
    window = window_with([[1, 2, 3], [4, 5, 6]])
    assert window.flat_tokens().tolist() == [1, 2, 3, 4, 5, 6]


def test_advance_one_committed_moves_levels_up():
    window = window_with([[1, 2, 3], [4, 5, 6]])
    outputs = np.array([11, 12, 13, 14, 15, 16])  # argmax of rows (0,0)..(1,2)
    window.advance(outputs, 1, np.array([40, 41]))
    assert window.tokens.tolist() == [[4, 5, 6], [14, 15, 16]]


@pytest.mark.parametrize("n_committed, kept", [
    (2, [[5, 6], [15, 16]]),  # shift left by 1
    (3, [[6], [16]]),  # shift left by 2
    (4, [[], []]),  # shift by the whole width: all refilled
    (9, [[], []]),
])  # fmt: skip
def test_advance_many_committed_shifts_columns(n_committed, kept):
    context = np.array([40, 41, 42, 43])
    window = window_with([[1, 2, 3], [4, 5, 6]])
    window.advance(np.array([11, 12, 13, 14, 15, 16]), n_committed, context)
    tokens = window.tokens
    assert tokens.shape == (2, 3)
    width = len(kept[0])
    assert tokens[:, :width].tolist() == kept
    assert np.isin(tokens[:, width:], context).all()  # vacated columns refilled from the context
    assert tokens.dtype == np.int64


def test_advance_keeps_positions_consistent():
    """A token guessed for absolute position p stays at position p after the root moves by n_committed."""
    levels, columns, root = 3, 5, 100
    window = JacobiWindow(levels, columns)
    window.reset(np.arange(1000, 1010))
    window.tokens[:] = np.arange(levels * columns).reshape(levels, columns)  # token = cell id
    outputs = 500 + np.arange(levels * columns)  # output of cell r guesses position(r) + 1
    position = {int(t): root + int(o) for t, o in zip(window.flat_tokens(), window.offsets)}
    position |= {int(t): root + int(o) + 1 for t, o in zip(outputs, window.offsets)}
    for n_committed in (1, 2, 4):
        moved = window_with(window.tokens)
        moved.advance(outputs, n_committed, np.array([-1]))
        new_root = root + n_committed
        for t, o in zip(moved.flat_tokens(), moved.offsets):
            if t != -1:
                assert position[int(t)] == new_root + int(o)


@pytest.mark.parametrize("levels", [1, 2, 3, 4])
def test_harvest_starts_after_levels_minus_one_advances(levels):
    columns = 3
    window = JacobiWindow(levels, columns, seed=1)
    window.reset(np.arange(10))
    for step in range(levels + 2):
        before = window.tokens.copy()
        outputs = 100 * (step + 1) + np.arange(levels * columns)
        grams = window.advance(outputs, 1, np.arange(10))
        assert grams.dtype == np.int64
        if step < levels - 1:
            assert grams.shape == (0, levels + 1)
        else:
            expected = [before[:, j].tolist() + [int(outputs[(levels - 1) * columns + j])] for j in range(columns)]
            assert grams.tolist() == expected


def test_harvest_literal_2x3():
    window = window_with([[1, 2, 3], [4, 5, 6]])
    assert window.advance(np.array([11, 12, 13, 14, 15, 16]), 1, np.array([0])).shape == (0, 3)
    assert window.tokens.tolist() == [[4, 5, 6], [14, 15, 16]]
    grams = window.advance(np.array([21, 22, 23, 24, 25, 26]), 2, np.array([0]))
    assert grams.tolist() == [[4, 14, 24], [5, 15, 25], [6, 16, 26]]
    assert window.tokens.tolist() == [[15, 16, 0], [25, 26, 0]]


def test_reset_fills_from_context_only_and_restarts_harvest():
    window = JacobiWindow(2, 4, seed=3)
    context = np.array([7, 9, 11])
    window.reset(context)
    assert np.isin(window.tokens, context).all()
    assert window.advance(np.arange(8), 1, context).shape == (0, 3)
    assert window.advance(np.arange(8), 1, context).shape == (4, 3)
    window.reset(np.array([5]))
    assert (window.tokens == 5).all()
    assert window.advance(np.arange(8), 1, context).shape == (0, 3)  # random fill again: no harvest


def test_seed_makes_reset_reproducible():
    a, b = JacobiWindow(3, 4, seed=5), JacobiWindow(3, 4, seed=5)
    context = np.arange(50)
    a.reset(context)
    b.reset(context)
    np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.parametrize("levels, columns", [(0, 3), (2, 0), (-1, -1)])
def test_rejects_empty_window(levels, columns):
    with pytest.raises(ValueError):
        JacobiWindow(levels, columns)
