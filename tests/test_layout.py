"""Tests for lookahead/layout.py: ids, positions and the additive mask of `pack` (literal case, brute-force
visibility, hidden prefix slots, the single-row fast path), and one tiny-model forward showing that the packed
window rows give the logits of the Jacobi sequences they stand for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lookahead.compat import CACHE_KWARG, output_cache
from lookahead.jacobi import JacobiWindow
from lookahead.layout import StepInputs, pack
from lookahead.tree import DraftTree

CPU = torch.device("cpu")


def literal_tree() -> DraftTree:
    # nodes: 0 root(9), 1:[1], 2:[1,2], 3:[1,2,3], 4:[1,2,4], 5:[5]
    return DraftTree.from_paths(9, [[1, 2, 3], [1, 2, 4], [5]], [0, 0, 0], budget=10)


def literal_window() -> JacobiWindow:
    window = JacobiWindow(2, 3)
    window.reset(np.array([0]))
    window.tokens[:] = [[31, 32, 33], [34, 35, 36]]
    return window


def expected_visibility(tree: DraftTree, window: JacobiWindow | None) -> np.ndarray:
    """[T, T] bool built from the documented rules only (parents walk; Jacobi cell rule)."""
    n = tree.size
    m = 0 if window is None else window.size
    vis = np.zeros((n + m, n + m), dtype=bool)
    for i in range(n):
        j = i
        while j != -1:
            vis[i, j] = True
            j = int(tree.parents[j])
    for r in range(m):
        level, column = divmod(r, window.columns)
        vis[n + r, 0] = True  # the root
        for c in range(column + 1):
            vis[n + r, n + c] = True
        for lv in range(1, level + 1):
            vis[n + r, n + lv * window.columns + column] = True
    return vis


def visible(inputs: StepInputs, dtype: torch.dtype) -> np.ndarray:
    """The mask as bool after checking every entry is exactly 0 or finfo.min."""
    mask = inputs.attention_mask[0, 0]
    blocked = torch.finfo(dtype).min
    assert bool(((mask == 0) | (mask == blocked)).all())
    return (mask == 0).numpy()


def test_literal_tree_and_window():
    tree, window = literal_tree(), literal_window()
    inputs = pack(tree, window, root_position=20, prefix_len=4, prefix_hidden=None, dtype=torch.float32,
                  device=CPU)
    assert inputs.n_tree == (6,)
    assert inputs.input_ids.tolist() == [[9, 1, 2, 3, 4, 5, 31, 32, 33, 34, 35, 36]]
    assert inputs.input_ids.dtype == torch.int64
    # tree: 20 + depth; window: 20 + 1 + column + level
    assert inputs.position_ids.tolist() == [[20, 21, 22, 23, 23, 21, 21, 22, 23, 22, 23, 24]]
    assert inputs.position_ids.dtype == torch.int64
    assert inputs.attention_mask.shape == (1, 1, 12, 16)
    assert inputs.attention_mask.dtype == torch.float32
    expected = np.array([
        # 0  1  2  3  4  5 |31 32 33 34 35 36
        [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # [1]
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # [1,2]
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # [1,2,3]
        [1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0],  # [1,2,4]
        [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0],  # [5]
        [1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0],  # (0,0)
        [1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],  # (0,1)
        [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # (0,2)
        [1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0],  # (1,0)
        [1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 0],  # (1,1)
        [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1],  # (1,2)
    ], dtype=bool)  # fmt: skip
    vis = visible(inputs, torch.float32)
    assert vis[:, :4].all()  # the whole cached prefix is visible
    np.testing.assert_array_equal(vis[:, 4:], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_window", [False, True])
def test_brute_force_visibility(dtype, with_window):
    tree = DraftTree.from_paths(4, [[1, 2, 3, 1], [1, 3], [2, 2], [1, 2, 0]], [0, 1, 0, 1], budget=7)
    window = JacobiWindow(3, 4) if with_window else None
    if window is not None:
        window.reset(np.arange(40, 60))
    prefix_len = 5
    inputs = pack(tree, window, root_position=7, prefix_len=prefix_len, prefix_hidden=None, dtype=dtype,
                  device=CPU)
    n, m = tree.size, 0 if window is None else window.size
    assert inputs.attention_mask.shape == (1, 1, n + m, prefix_len + n + m)
    assert inputs.attention_mask.dtype == dtype
    vis = visible(inputs, dtype)
    assert vis[:, :prefix_len].all()
    expected = expected_visibility(tree, window)
    np.testing.assert_array_equal(vis[:, prefix_len:], expected)
    # tree and window never see each other
    assert not vis[:n, prefix_len + n:].any()
    assert not vis[n:, prefix_len + 1:prefix_len + n].any()
    if window is not None:
        assert vis[n:, prefix_len].all()  # window rows see the root
    positions = inputs.position_ids[0].numpy()
    np.testing.assert_array_equal(positions[:n], 7 + tree.depth)
    if window is not None:
        np.testing.assert_array_equal(positions[n:], 7 + window.offsets)
        np.testing.assert_array_equal(inputs.input_ids[0, n:].numpy(), window.flat_tokens())
    np.testing.assert_array_equal(inputs.input_ids[0, :n].numpy(), tree.tokens)


def test_prefix_hidden_blocks_only_those_slots_for_every_row():
    tree, window = literal_tree(), literal_window()
    hidden = torch.tensor([True, True, False, False, True])
    inputs = pack(tree, window, root_position=2, prefix_len=5, prefix_hidden=hidden, dtype=torch.float64,
                  device=CPU)
    vis = visible(inputs, torch.float64)
    assert vis.shape == (12, 17)
    assert (vis[:, :5] == ~hidden.numpy()).all()
    np.testing.assert_array_equal(vis[:, 5:], expected_visibility(tree, window))


def test_single_row_without_hidden_slots_has_no_mask():
    root_only = DraftTree.from_paths(7, [], [], budget=5)
    inputs = pack(root_only, None, root_position=12, prefix_len=12, prefix_hidden=None, dtype=torch.float32,
                  device=CPU)
    assert inputs.attention_mask is None
    assert inputs.input_ids.tolist() == [[7]]
    assert inputs.position_ids.tolist() == [[12]]
    assert inputs.n_tree == (1,)


def test_single_row_with_hidden_slots_keeps_the_mask():
    root_only = DraftTree.from_paths(7, [], [], budget=5)
    hidden = torch.tensor([True, False, False])
    inputs = pack(root_only, None, root_position=2, prefix_len=3, prefix_hidden=hidden, dtype=torch.float32,
                  device=CPU)
    blocked = torch.finfo(torch.float32).min
    assert inputs.attention_mask.tolist() == [[[[blocked, 0.0, 0.0, 0.0]]]]


def test_root_with_window_only_and_empty_prefix():
    root_only = DraftTree.from_paths(7, [], [], budget=5)
    window = literal_window()
    inputs = pack(root_only, window, root_position=0, prefix_len=0, prefix_hidden=None, dtype=torch.float32,
                  device=CPU)
    assert inputs.attention_mask.shape == (1, 1, 7, 7)
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4]]
    np.testing.assert_array_equal(visible(inputs, torch.float32), expected_visibility(root_only, window))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_forward_matches_sequential_forwards(tiny_model, family):
    """Every tree row and every window row of one packed forward gives the logits of a plain forward of the
    token sequence it stands for (prompt + root + path, or prompt + root + its Jacobi sequence)."""
    model = tiny_model(family)
    prompt = [3, 17, 42, 8, 23]
    tree = DraftTree.from_paths(11, [[5, 6, 7], [5, 9], [12]], [0, 0, 0], budget=10)
    window = JacobiWindow(2, 3)
    window.reset(np.array([0]))
    window.tokens[:] = [[31, 32, 33], [34, 35, 36]]
    with torch.no_grad():
        cache = output_cache(model(torch.tensor([prompt]), use_cache=True))
        inputs = pack(tree, window, root_position=len(prompt), prefix_len=len(prompt), prefix_hidden=None,
                      dtype=model.dtype, device=CPU)
        logits = model(input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                       attention_mask=inputs.attention_mask, **{CACHE_KWARG: cache}).logits[0]
        jacobi = {0: [31], 1: [31, 32], 2: [31, 32, 33], 3: [31, 34], 4: [31, 32, 35], 5: [31, 32, 33, 36]}
        sequences = [tree.path_tokens(n) for n in range(tree.size)] + [jacobi[r] for r in range(6)]
        for row, tail in enumerate(sequences):
            ref = model(torch.tensor([prompt + [11] + tail])).logits[0, -1]
            torch.testing.assert_close(logits[row], ref, rtol=0, atol=1e-9, msg=f"row {row}")
