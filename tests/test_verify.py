"""Tests for lookahead/verify.py: greedy walks on hand-built logits (full branch + leaf bonus, rejection at the
root, sibling choice, ties), the lazy scorer path, and a property test against a reference walk."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.tree import DraftTree
from lookahead.recycle import top_k
from lookahead.verify import Verdict, argmax_of, verify_greedy

V = 8


def literal_tree() -> DraftTree:
    # nodes: 0 root(9)  1:[1]  2:[1,2]  3:[1,2,3]  4:[1,4]  5:[5]
    tree = DraftTree.from_paths(9, [[1, 2, 3], [1, 4], [5]], [0, 0, 0], budget=10)
    assert [tree.path_tokens(n) for n in range(tree.size)] == [[], [1], [1, 2], [1, 2, 3], [1, 4], [5]]
    return tree


def logits_with_argmax(argmax: list[int], second: list[int] | None = None) -> torch.Tensor:
    """[N, V] logits whose row i peaks at argmax[i] (score 5) and, optionally, has second[i] at score 3."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.rand(len(argmax), V, generator=gen)  # noise in [0, 1)
    for row, token in enumerate(argmax):
        logits[row, token] = 5.0
        if second is not None:
            logits[row, second[row]] = 3.0
    return logits


@pytest.mark.parametrize("argmax, tokens, path", [
    ([1, 2, 3, 7, 0, 0], [1, 2, 3, 7], [0, 1, 2, 3]),  # whole branch accepted, leaf's argmax is the bonus
    ([1, 2, 3, 1, 0, 0], [1, 2, 3, 1], [0, 1, 2, 3]),  # bonus equal to an earlier token is still emitted
    ([6, 2, 3, 7, 0, 0], [6], [0]),  # rejected at the root: bonus only
    ([1, 4, 3, 7, 6, 0], [1, 4, 6], [0, 1, 4]),  # picks the second sibling under [1]
    ([5, 2, 3, 7, 0, 2], [5, 2], [0, 5]),  # picks the root's later child
    ([1, 2, 6, 7, 0, 0], [1, 2, 6], [0, 1, 2]),  # rejected mid-branch
    ([1, 0, 3, 7, 0, 0], [1, 0], [0, 1]),
])  # fmt: skip
def test_greedy_literal(argmax, tokens, path):
    tree = literal_tree()
    verdict = verify_greedy(tree, logits_with_argmax(argmax))
    assert isinstance(verdict, Verdict)
    assert verdict.tokens == tokens
    assert verdict.path == path
    assert verdict.n_accepted == len(path) - 1 == len(tokens) - 1
    assert all(type(t) is int for t in verdict.tokens)


def test_root_only_tree_emits_the_root_argmax():
    tree = DraftTree.from_paths(4, [], [], budget=3)
    verdict = verify_greedy(tree, logits_with_argmax([6]))
    assert (verdict.tokens, verdict.path, verdict.n_accepted) == ([6], [0], 0)


def test_ties_take_the_lowest_token_like_torch_argmax():
    tree = literal_tree()
    logits = torch.zeros(6, V)
    logits[0, [1, 5]] = 2.0  # tie at the root between children 1 and 5: token 1 (lowest id) wins
    logits[1, [4, 2]] = 2.0  # tie between [1,4] and [1,2]: token 2
    logits[2, :] = 1.0  # all equal: token 0, no child -> bonus
    verdict = verify_greedy(tree, logits)
    assert verdict.tokens == [1, 2, 0]
    assert verdict.path == [0, 1, 2]


def test_scorer_that_bans_a_token_changes_the_walk():
    tree = literal_tree()
    # raw: root -> 1 (second best 5), [1] -> 2, [1,2] -> 3; [5] -> 6
    logits = logits_with_argmax([1, 2, 3, 7, 0, 6], second=[5, 4, 0, 0, 0, 0])
    assert verify_greedy(tree, logits).tokens == [1, 2, 3, 7]

    def ban_one(path, row):
        row = row.clone()
        row[1] = -float("inf")
        return row

    verdict = verify_greedy(tree, logits, ban_one)
    assert verdict.tokens == [5, 6]
    assert verdict.path == [0, 5]

    def ban_two_after_one(path, row):  # depends on the path: only bans 2 right after 1
        row = row.clone()
        if path[-1:] == [1]:
            row[2] = -float("inf")
        return row

    verdict = verify_greedy(tree, logits, ban_two_after_one)
    assert verdict.tokens == [1, 4, 0]
    assert verdict.path == [0, 1, 4]


def test_scorer_sees_each_visited_nodes_path_and_row_lazily():
    tree = literal_tree()
    logits = logits_with_argmax([1, 2, 3, 7, 0, 6])
    calls = []

    def recording(path, row):
        calls.append((list(path), row.clone()))
        return row

    verdict = verify_greedy(tree, logits, recording)
    assert verdict.tokens == [1, 2, 3, 7]
    assert [p for p, _ in calls] == [[], [1], [1, 2], [1, 2, 3]]  # only the visited nodes, in walk order
    for (path, row), node in zip(calls, verdict.path, strict=True):
        assert path == tree.path_tokens(node)
        assert torch.equal(row, logits[node])


def test_identity_scorer_agrees_with_raw_argmax():
    tree = literal_tree()
    gen = torch.Generator().manual_seed(3)
    for _ in range(30):
        logits = torch.randn(6, V, generator=gen)
        logits[:, [1, 2, 3, 4, 5]] += 1.0  # make acceptance likely
        plain = verify_greedy(tree, logits)
        scored = verify_greedy(tree, logits, lambda path, row: row)
        assert (plain.tokens, plain.path) == (scored.tokens, scored.path)


def reference_walk(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Greedy walk using only parents/tokens (no `children`)."""
    node, path, tokens = 0, [0], []
    while True:
        token = int(np.argmax(logits[node].numpy()))
        tokens.append(token)
        match = [c for c in range(1, tree.size) if tree.parents[c] == node and tree.tokens[c] == token]
        if not match:
            return tokens, path
        node = match[0]
        path.append(node)


@settings(max_examples=150, deadline=None)
@given(paths=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=6),
       budget=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_greedy_matches_reference_walk(paths, budget, seed):
    tree = DraftTree.from_paths(0, paths, [0] * len(paths), budget)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tree.size, 6, generator=gen)
    logits[:, :4] += 1.5  # tokens the tree uses are likelier, so walks go deep
    verdict = verify_greedy(tree, logits)
    assert (verdict.tokens, verdict.path) == reference_walk(tree, logits)
    assert verdict.tokens[:-1] == tree.path_tokens(verdict.path[-1])


@settings(max_examples=100, deadline=None)
@given(paths=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=6),
       budget=st.integers(0, 12), seed=st.integers(0, 2**16), k=st.integers(1, 6))
def test_the_walk_on_top_k_argmaxes_is_the_walk_on_the_logits(paths, budget, seed, k):
    """Greedy steps take each row's argmax from the top-k recycling reads (`Sequence.verify`): the same walk as
    on the logits themselves, ties included (integer logits: many)."""
    tree = DraftTree.from_paths(0, paths, [0] * len(paths), budget)
    logits = torch.randint(-3, 4, (tree.size, 6), generator=torch.Generator().manual_seed(seed)).float()
    tops = top_k(logits, k)
    argmax = argmax_of(tops.indices, tops.nan_free)
    assert argmax is not None and np.array_equal(argmax, logits.argmax(dim=-1).numpy())
    walked = verify_greedy(tree, logits, None, argmax)
    assert (walked.tokens, walked.path) == reference_walk(tree, logits)


def test_rows_with_a_nan_or_nothing_above_minus_infinity_leave_the_argmax_to_torch():
    inf = float("inf")
    edges = torch.tensor([[-inf, -inf, -inf], [0.0, inf, inf], [-inf, 1.0, 1.0]])
    tops = top_k(edges, 2)
    assert argmax_of(tops.indices, tops.nan_free) is None  # the all -inf row: torch says token 0
    assert argmax_of(tops.indices[1:], tops.nan_free[1:]).tolist() == edges[1:].argmax(dim=-1).tolist() == [1, 1]
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, float("nan"), 1.0]])
    tops = top_k(logits, 2)
    assert argmax_of(tops.indices, tops.nan_free) is None  # torch's argmax picks the NaN (token 1), a top-k never
    assert argmax_of(tops.indices[:1], tops.nan_free[:1]).tolist() == [1]
    tree = DraftTree.from_paths(0, [[1]], [0], budget=4)
    assert verify_greedy(tree, logits, None, None).tokens == [1, 1]  # as plain greedy would: the NaN's token
