"""Tests for lookahead/tree.py: literal pruning tables, error cases, and property tests of the trie invariants
against a pure-Python reference (distinct prefixes, documented scores, stable ranking)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.tree import DraftTree

DECAY = 0.8  # the documented per-depth score decay


def prefixes(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's path as a tuple of tokens, by walking parents (independent of `path_tokens`)."""
    out = []
    for node in range(tree.size):
        walk = []
        while node != 0:
            walk.append(int(tree.tokens[node]))
            node = int(tree.parents[node])
        out.append(tuple(reversed(walk)))
    return out


def reference_tree(paths, sources, budget):
    """Kept prefixes in node order and their sources, per the documented rule.

    Node score = sum over paths through it of 1/(rank+1) * DECAY**depth; root plus the `budget` best nodes
    (ties: created earlier first) are kept; kept nodes are numbered in creation order.
    """
    created, score, source = [], {}, {}
    for rank, path in enumerate(paths):
        for depth in range(1, len(path) + 1):
            prefix = tuple(int(t) for t in path[:depth])
            if prefix not in score:
                created.append(prefix)
                score[prefix], source[prefix] = 0.0, sources[rank]
            score[prefix] += 1.0 / (rank + 1) * DECAY**depth
    ranked = sorted(range(len(created)), key=lambda i: (-score[created[i]], i))
    kept = sorted(ranked[:budget])
    return [()] + [created[i] for i in kept], [-1] + [source[created[i]] for i in kept]


# ---------------------------------------------------------------- literal cases


def test_literal_full_tree_layout():
    tree = DraftTree.from_paths(9, [[1, 2, 3], [1, 2, 4], [5]], [0, 1, 2], budget=10)
    assert tree.tokens.tolist() == [9, 1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 2, 0]
    assert tree.depth.tolist() == [0, 1, 2, 3, 3, 1]
    assert tree.source.tolist() == [-1, 0, 0, 0, 1, 2]
    assert tree.size == 6
    assert [dict(c) for c in tree.children] == [{1: 1, 5: 5}, {2: 2}, {3: 3, 4: 4}, {}, {}, {}]
    assert [tree.path_tokens(n) for n in range(6)] == [[], [1], [1, 2], [1, 2, 3], [1, 2, 4], [5]]
    for array in (tree.tokens, tree.parents, tree.depth, tree.source):
        assert array.dtype == np.int64


# scores: [1]=1.5*.8=1.2, [1,2]=1.5*.64=.96, [1,2,3]=.512, [1,2,4]=.5*.512=.256, [5]=(1/3)*.8=.2667
@pytest.mark.parametrize("budget, tokens, parents", [
    (0, [9], [-1]),
    (1, [9, 1], [-1, 0]),
    (2, [9, 1, 2], [-1, 0, 1]),
    (3, [9, 1, 2, 3], [-1, 0, 1, 2]),
    (4, [9, 1, 2, 3, 5], [-1, 0, 1, 2, 0]),  # [5] (.2667) beats the deeper [1,2,4] (.256)
    (5, [9, 1, 2, 3, 4, 5], [-1, 0, 1, 2, 2, 0]),
    (50, [9, 1, 2, 3, 4, 5], [-1, 0, 1, 2, 2, 0]),
])  # fmt: skip
def test_literal_budget_pruning(budget, tokens, parents):
    tree = DraftTree.from_paths(9, [[1, 2, 3], [1, 2, 4], [5]], [0, 1, 2], budget=budget)
    assert tree.tokens.tolist() == tokens
    assert tree.parents.tolist() == parents


def test_literal_shared_prefix_outranks_a_better_ranked_single_path():
    # [7] only from rank 0: .8; [3] from ranks 1, 2, 3: (1/2 + 1/3 + 1/4) * .8 = .8667 -> kept first at budget 1.
    tree = DraftTree.from_paths(0, [[7], [3, 1], [3, 2], [3, 4]], [0, 1, 1, 1], budget=1)
    assert tree.tokens.tolist() == [0, 3]
    assert tree.source.tolist() == [-1, 1]


def test_literal_tie_goes_to_the_earlier_created_node():
    # [4, 5] (rank 3, depth 2) and [6] (rank 4, depth 1) both score exactly 0.16000000000000003;
    # [4, 5] was created first, so it wins although it is deeper.
    paths = [[1], [2], [3], [4, 5], [6]]
    assert 0.25 * DECAY**2 == 0.2 * DECAY
    tree = DraftTree.from_paths(0, paths, [0, 1, 2, 3, 4], budget=5)
    assert tree.tokens.tolist() == [0, 1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 0, 4]
    tree = DraftTree.from_paths(0, paths, [0, 1, 2, 3, 4], budget=4)
    assert tree.tokens.tolist() == [0, 1, 2, 3, 4]


def test_source_is_the_best_ranked_path_that_created_the_node():
    tree = DraftTree.from_paths(0, [[1, 2], [1, 3], [4]], [7, 5, 6], budget=10)
    # [1] is on paths of source 7 and 5: created by the rank-0 path, so source 7.
    assert dict(zip(map(tuple, (tree.path_tokens(n) for n in range(tree.size))), tree.source.tolist())) == {
        (): -1, (1,): 7, (1, 2): 7, (1, 3): 5, (4,): 6}


def test_root_only_and_empty_paths():
    for paths, sources in (([], []), ([[], []], [0, 1])):
        tree = DraftTree.from_paths(3, paths, sources, budget=4)
        assert tree.tokens.tolist() == [3]
        assert tree.parents.tolist() == [-1]
        assert tree.depth.tolist() == [0]
        assert tree.ancestor_mask().tolist() == [[True]]
        assert tree.path_tokens(0) == []


def test_numpy_paths_and_tokens_equal_to_root():
    # Drafters hand over numpy arrays; a child may carry the root's own token.
    tree = DraftTree.from_paths(np.int64(2), [np.array([2, 2]), np.array([2, 5])], [0, 1], budget=10)
    assert tree.tokens.tolist() == [2, 2, 2, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 1]


def test_ancestor_mask_literal():
    tree = DraftTree.from_paths(9, [[1, 2, 3], [1, 2, 4], [5]], [0, 1, 2], budget=10)
    expected = np.array([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],
        [1, 0, 0, 0, 0, 1],
    ], dtype=bool)  # fmt: skip
    mask = tree.ancestor_mask()
    assert mask.dtype == bool
    np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("paths, sources, budget", [
    ([[1]], [], 3),
    ([[1], [2]], [0], 3),
    ([[1]], [0, 1], 3),
    ([[1]], [0], -1),
])  # fmt: skip
def test_errors(paths, sources, budget):
    with pytest.raises(ValueError):
        DraftTree.from_paths(0, paths, sources, budget)


# ---------------------------------------------------------------- properties

paths_strategy = st.lists(st.lists(st.integers(0, 3), max_size=5), max_size=7)


@settings(max_examples=200, deadline=None)
@given(root=st.integers(0, 3), paths=paths_strategy, budget=st.integers(0, 20), data=st.data())
def test_tree_properties(root, paths, budget, data):
    sources = data.draw(st.lists(st.integers(0, 3), min_size=len(paths), max_size=len(paths)))
    tree = DraftTree.from_paths(root, paths, sources, budget)
    n = tree.size
    distinct = {tuple(p[:d]) for p in paths for d in range(1, len(p) + 1)}

    # root is node 0, parents precede children, depth follows parents
    assert tree.tokens[0] == root and tree.parents[0] == -1 and tree.depth[0] == 0 and tree.source[0] == -1
    for i in range(1, n):
        assert 0 <= tree.parents[i] < i
        assert tree.depth[i] == tree.depth[tree.parents[i]] + 1
    # size: exactly the budget (or every distinct prefix when they fit)
    assert n == min(budget, len(distinct)) + 1 <= budget + 1

    nodes = prefixes(tree)
    # siblings distinct <=> no two nodes share a path; prefix-closed; every node a prefix of some input path
    assert len(set(nodes)) == n
    assert all(p[:-1] in set(nodes) for p in nodes[1:])
    assert set(nodes[1:]) <= distinct
    if budget >= len(distinct):
        assert set(nodes[1:]) == distinct
    assert [tuple(tree.path_tokens(i)) for i in range(n)] == nodes

    # children agrees with parents/tokens, and has nothing else
    assert sum(len(c) for c in tree.children) == n - 1
    for i in range(1, n):
        assert tree.children[tree.parents[i]][int(tree.tokens[i])] == i

    # ancestor mask equals a brute-force walk
    expected = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j != -1:
            expected[i, j] = True
            j = int(tree.parents[j])
    np.testing.assert_array_equal(tree.ancestor_mask(), expected)

    # kept nodes, their order and their sources follow the documented scoring exactly
    kept, kept_sources = reference_tree(paths, sources, budget)
    assert nodes == kept
    assert tree.source.tolist() == kept_sources
