"""Tests for lookahead/recycle.py: the adjacency table of recycled top-k predictions, best-first draft growth,
sharing across drafters and threads, and its place in the drafters' trie."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from lookahead import recycle
from lookahead.config import LookaheadConfig
from lookahead.drafters import RECYCLE, RECYCLE_PAIR, RECYCLE_SOURCES, SOURCE_DRAFTER, Drafters
from lookahead.gumbel import gumbel_of, index_key
from lookahead.recycle import RecycleDrafter, RecycleTable

K = 3


def _table(rows: dict[int, list[int]], vocab: int = 16) -> RecycleTable:
    """A RecycleTable whose rows are given literally: {token: its top-K next tokens, best first}, each row's top-1
    confident (recycled logits 9, 1, 0: classes 0, 2, 3)."""
    table = RecycleTable(K)
    table.ensure(vocab, K)
    tokens = np.array(list(rows), dtype=np.int64)
    table.update(tokens, np.array(list(rows.values()), dtype=np.int64),
                 np.array([[9.0, 1.0, 0.0]] * len(rows), dtype=np.float32))
    return table


def _drafter(table: RecycleTable, nodes: int, depth: int, vocab: int = 16) -> RecycleDrafter:
    return RecycleDrafter(table, vocab, K, nodes, depth)


def _paths(drafter: RecycleDrafter, root: int, value, max_len: int = 8):
    paths, ranks = drafter.propose(root, np.asarray(value, dtype=np.float64), max_len)
    return [p.tolist() for p in paths], ranks.tolist()


def test_update_overwrites_rows_in_order_and_clear_forgets():
    table = _table({1: [2, 3, 4]})
    table.update(np.array([5, 1, 1]), np.array([[6, 7, 8], [9, 10, 11], [12, 13, 14]]))
    assert table.table[1].tolist() == [12, 13, 14]  # the later row of a repeated token wins
    assert table.table[5].tolist() == [6, 7, 8] and table.table[0].tolist() == [-1, -1, -1]
    assert table.known_tokens == 2
    table.update(np.array([99]), np.array([[1, 2, 3]]))  # outside the vocabulary: skipped
    assert table.known_tokens == 2
    table.clear()
    assert table.known_tokens == 0 and table.table.shape == (16, K)


def test_ensure_reshapes_only_on_change():
    table = _table({1: [2, 3, 4]})
    table.ensure(16, K)
    assert table.known_tokens == 1
    table.ensure(32, K)
    assert table.table.shape == (32, K) and table.known_tokens == 0
    with pytest.raises(ValueError, match="k must be"):
        RecycleTable(0)


def test_observe_stores_each_rows_top_k_from_logits():
    table = RecycleTable(K)
    drafter = RecycleDrafter(table, 8, K, 4, 2)
    logits = torch.tensor([[0.0, 5, 1, 4, 0, 0, 3, 0],   # row carrying token 2: best 1, 3, 6
                           [9.0, 0, 0, 0, 0, 8, 0, 7]])  # row carrying token 4: best 0, 5, 7
    drafter.observe(np.array([2, 4]), logits)
    assert table.table[2].tolist() == [1, 3, 6] and table.table[4].tolist() == [0, 5, 7]
    drafter.observe(np.array([2, 2]), logits, order=np.array([1, 0]))  # row 0 last: it wins
    assert table.table[2].tolist() == [1, 3, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_k_is_torch_topk_ties_to_the_lower_token(dtype):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(-20, 20, (5, 300), generator=generator).to(dtype)  # many ties
    logits[2] = 1.0  # a row of one value: the first k tokens
    indices, values, nan_free = recycle.top_k(logits, 8)
    expected = torch.sort(logits, dim=-1, descending=True, stable=True)
    assert np.array_equal(values, expected.values[:, :8].float().numpy()) and nan_free.all()
    if dtype == torch.float32:  # our pass: ties in token order (torch.topk does not promise one)
        assert np.array_equal(indices, expected.indices[:, :8].numpy())
        assert indices[2].tolist() == list(range(8))
        assert np.array_equal(indices[:, 0], logits.argmax(dim=-1).numpy())  # the first column is torch's argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_k_says_which_rows_hold_a_nan_and_our_pass_never_picks_one(dtype):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, float("nan"), 2.0, 0.0], [1.0, float("inf"), 2.0, 0.0],
                           [float("-inf"), 3.0, 2.0, 0.0]], dtype=dtype)
    indices, values, nan_free = recycle.top_k(logits, 2)
    assert nan_free.tolist() == [True, False, True, True]
    if dtype == torch.float32:  # our pass (torch.topk, for other rows, ranks NaN first)
        assert indices.tolist() == [[1, 2], [2, 0], [1, 2], [1, 2]] and values[1].tolist() == [2.0, 1.0]


# Root 1's predictions are 2, 3, 4; 2's are 5, 6, 7; 5's are 8, 9, 10; the rest are unknown.
CHAIN = {1: [2, 3, 4], 2: [5, 6, 7], 5: [8, 9, 10]}


@pytest.mark.parametrize("value, expected", [
    # (columns: classes 0-3) Confident top-1 predictions: the growth follows the chain deep before widening.
    ([[0.9, 0.5, 0.05, 0.01]] * 3, [[2], [2, 5], [2, 5, 8], [3]]),
    # Flat estimates: breadth first at the root.
    ([[0.3] * 4] * 3, [[2], [3], [4], [2, 5]]),
    # Per depth: a confident second token, a weak third one.
    ([[0.5, 0.5, 0.45, 0.3], [0.95, 0.5, 0.1, 0.1], [0.1] * 4], [[2], [2, 5], [3], [4]]),
])
def test_growth_is_best_first_on_the_estimates(value, expected):
    drafter = _drafter(_table(CHAIN), nodes=4, depth=3)
    paths, _ = _paths(drafter, 1, value)
    assert paths == expected


def test_growth_respects_node_depth_and_length_limits_and_reports_ranks():
    drafter = _drafter(_table(CHAIN), nodes=32, depth=2)
    value = [[0.5, 0.45, 0.4, 0.3]] * 2
    paths, classes = _paths(drafter, 1, value)
    assert max(len(p) for p in paths) == 2 and len(paths) == 3 + 3  # root's 3 children, 2's 3 children
    assert {tuple(p): c for p, c in zip(paths, classes)}[(2, 6)] == 2  # a second prediction
    short, _ = _paths(drafter, 1, value, max_len=1)
    assert short == [[2], [3], [4]]
    assert _paths(drafter, 7, value) == ([], [])  # a root never verified: no draft
    assert _paths(drafter, 99, value) == ([], [])  # outside the table


def test_every_path_extends_an_earlier_one():
    """Paths come parents first, so merging them in order gives each node its own rank's source."""
    rng = np.random.default_rng(0)
    table = RecycleTable(K)
    table.ensure(12, K)
    table.update(np.arange(12), np.stack([rng.choice(12, K, replace=False) for _ in range(12)]))
    paths, _ = _paths(RecycleDrafter(table, 12, K, 20, 5), 0, [[0.6, 0.3, 0.1]] * 5)
    seen = {()}
    for path in paths:
        assert tuple(path[:-1]) in seen
        seen.add(tuple(path))
    assert len(seen) == 21


def test_drafters_merge_recycled_nodes_with_class_sources_and_share_the_table():
    config = LookaheadConfig(window_levels=0, pool_candidates=0, prompt_candidates=0, recycle_k=K,
                             recycle_nodes=6, max_draft_len=3)
    table = RecycleTable(K)
    first = Drafters(config, 16, np.array([3, 1]), recycle_table=table)
    first.recycle_rows(np.array([1, 2]), torch.tensor([[0.0] * 16] * 2).index_put_(
        (torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([2, 3, 4, 5, 6, 7])), torch.tensor([9.0, 2, 1, 3, 2, 1])))
    assert table.table[1].tolist() == [2, 3, 4]  # token 1's top-1 holds 0.999 of the row: confident; token 2's 0.67
    second = Drafters(config, 16, np.array([9, 1]), recycle_table=table)  # another generation, same table
    tree = second.draft(1, max_len=3)
    assert tree.size == 7
    by_path = {tuple(tree.path_tokens(n)): int(tree.source[n]) for n in range(1, tree.size)}
    assert by_path[(2,)] == RECYCLE and by_path[(2, 5)] == RECYCLE + 1  # a confident and a less confident top-1
    assert by_path[(3,)] == by_path[(2, 6)] == RECYCLE + 2 and by_path[(4,)] == by_path[(2, 7)] == RECYCLE + 3
    assert {SOURCE_DRAFTER[s] for s in by_path.values()} == {"recycle"}
    assert SOURCE_DRAFTER[RECYCLE:RECYCLE + RECYCLE_SOURCES] == ("recycle",) * RECYCLE_SOURCES
    assert SOURCE_DRAFTER[RECYCLE_PAIR:RECYCLE_PAIR + RECYCLE_SOURCES] == ("recycle",) * RECYCLE_SOURCES
    off = Drafters(config.with_overrides(recycle_nodes=0), 16, np.array([9, 1]), recycle_table=table)
    assert off.draft(1, max_len=3).size == 1


def test_a_private_table_when_none_is_shared():
    config = LookaheadConfig(recycle_k=K)
    a, b = Drafters(config, 16, np.array([1])), Drafters(config, 16, np.array([1]))
    assert a.recycle.table is not b.recycle.table


def test_table_is_thread_safe_under_concurrent_updates_and_growth():
    table = RecycleTable(4)
    table.ensure(64, 4)
    errors = []

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            tokens = rng.integers(0, 64, 16)
            topk = np.stack([rng.choice(64, 4, replace=False) for _ in range(16)])
            table.update(tokens, topk)

    def reader() -> None:
        drafter = RecycleDrafter(table, 64, 4, 16, 4)
        for root in range(300):
            paths, _ = drafter.propose(root % 64, np.full((4, 4), 0.5), 4)
            errors.extend(path for path in paths if (path < 0).any())

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(3)] + [threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert ((table.table >= 0).all(axis=1) | (table.table < 0).all(axis=1)).all()  # rows never half-written


def test_rows_are_padded_to_k_and_predictions_outside_the_vocabulary_dropped():
    table = RecycleTable(4)
    table.ensure(6, 4)
    table.update(np.array([1, 2, 7]), np.array([[3, 9], [5, 0], [1, 1]]))  # a 6-token model: top-2 only
    assert table.table[1].tolist() == [3, -1, -1, -1] and table.table[2].tolist() == [5, 0, -1, -1]
    paths, _ = _paths(RecycleDrafter(table, 6, 4, 8, 3), 1, np.full((3, 4), 0.5))
    assert paths == [[3]]  # 3 was never verified: no grandchildren, and nothing outside the vocabulary


def test_the_recycling_table_persists_across_calls_and_can_be_shared():
    from tiny_models import build_tiny_model, repetitive_prompt

    from lookahead import Lookahead
    from lookahead.recycle import RecycleTable

    model = build_tiny_model("llama", seed=1)
    decoder = Lookahead(window_levels=0, pool_candidates=0, prompt_candidates=0)
    table = decoder.recycle_table
    assert isinstance(table, RecycleTable)
    model.generate(repetitive_prompt(0), do_sample=False, max_new_tokens=16, custom_generate=decoder)
    filled = int((table.table >= 0).sum())
    assert filled > 0 and decoder.recycle_table is table  # learned from the first call, kept for the next
    shared = Lookahead(recycle_table=table)
    assert shared.recycle_table is table
    assert Lookahead(recycle_nodes=0).recycle_table is None


def test_one_lookahead_object_keeps_its_table_across_calls():
    from tiny_models import build_tiny_model, repetitive_prompt

    from lookahead import Lookahead

    model = build_tiny_model("llama", dtype=torch.float64, seed=1)
    decoder = Lookahead(window_levels=0, pool_candidates=0, prompt_candidates=0)
    model.generate(repetitive_prompt(0), do_sample=False, max_new_tokens=16, custom_generate=decoder)
    known = decoder.recycle_table.known_tokens
    assert known > 0
    model.generate(repetitive_prompt(1), do_sample=False, max_new_tokens=16, custom_generate=decoder)
    assert decoder.recycle_table.known_tokens >= known
    shared = RecycleTable(4)
    other = Lookahead(recycle_table=shared)
    model.generate(repetitive_prompt(2), do_sample=False, max_new_tokens=8, custom_generate=other)
    assert other.recycle_table is shared and shared.known_tokens > 0


def _scored_table() -> RecycleTable:
    """Root 1 predicts 2, 3, 4 and token 2 predicts 5, 6, 7, each with recycled logits 3, 2, 1."""
    table = RecycleTable(K)
    table.ensure(16, K)
    logits = np.array([[3.0, 2.0, 1.0]] * 2, dtype=np.float32)
    table.update(np.array([1, 2]), np.array([[2, 3, 4], [5, 6, 7]]), logits)
    return table


CONFIDENT = np.array([[0.9, 0.9, 0.05, 0.01]] * 2)  # by class: a first-placed child is worth far more


def _key_ordering(logits: dict[int, float], order: list[int], inv_temp: float = 1.0) -> np.uint64:
    """A noise key (`gumbel.index_key` of some seed) under which the tokens of `logits` ({token: recycled logit})
    rank as `order` by logit * inv_temp + their Gumbel noise — the order of the seeded draw."""
    for seed in range(10_000):
        key = index_key(seed, 0)
        drawn = sorted(logits, key=lambda t: -(logits[t] * inv_temp + gumbel_of(key, t)))
        if drawn == order:
            return key
    raise AssertionError(f"no seed ranks {logits} as {order}")


ROOT_CHILDREN, CHILDREN_OF_2 = {2: 3.0, 3: 2.0, 4: 1.0}, {5: 3.0, 6: 2.0, 7: 1.0}  # as in `_scored_table`


def test_seeded_noise_orders_children_as_the_seeded_draw_would():
    drafter = _drafter(_scored_table(), nodes=3, depth=2)
    keys = np.array([_key_ordering(ROOT_CHILDREN, [4, 2, 3]),  # depth 1: token 4 drawn before 2 and 3
                     _key_ordering(CHILDREN_OF_2, [6, 5, 7])], dtype=np.uint64)  # depth 2: token 6 first
    paths, ranks = drafter.propose(1, CONFIDENT, 8, keys, 1.0)
    assert [p.tolist() for p in paths] == [[4], [2], [2, 6]] and ranks.tolist() == [1, 2, 1]  # first: class 1
    plain, plain_ranks = drafter.propose(1, CONFIDENT, 8)  # without noise: the top-k order
    assert [p.tolist() for p in plain] == [[2], [2, 5], [3]] and plain_ranks.tolist() == [1, 1, 2]


def test_seeded_noise_scales_the_recycled_logits_by_one_over_temperature():
    drafter = _drafter(_scored_table(), nodes=1, depth=2)
    def first(key, inv_temp):
        return max(ROOT_CHILDREN, key=lambda t: ROOT_CHILDREN[t] * inv_temp + gumbel_of(key, t))

    # a key whose draw takes token 2 at T = 1 and token 4 at T = 2
    key = next(k for k in map(lambda s: index_key(s, 0), range(10_000)) if first(k, 1.0) == 2 and first(k, 0.5) == 4)
    keys = np.array([key], dtype=np.uint64)
    assert drafter.propose(1, CONFIDENT, 8, keys, 1.0)[0][0].tolist() == [2]
    assert drafter.propose(1, CONFIDENT, 8, keys, 0.5)[0][0].tolist() == [4]


def test_noise_keys_reach_only_their_depths():
    drafter = _drafter(_scored_table(), nodes=3, depth=2)
    keys = np.array([_key_ordering(ROOT_CHILDREN, [3, 2, 4])], dtype=np.uint64)  # depth 1 only
    paths, ranks = drafter.propose(1, CONFIDENT, 8, keys, 1.0)
    assert [p.tolist() for p in paths] == [[3], [2], [2, 5]] and ranks.tolist() == [1, 2, 1]  # depth 2: top-k


def test_observe_keeps_the_recycled_logits_and_snapshots_restore_them():
    table = RecycleTable(K)
    drafter = RecycleDrafter(table, 8, K, 4, 2)
    drafter.observe(np.array([2]), torch.tensor([[0.0, 5, 1, 4, 0, 0, 3, 0]]))
    assert table.table[2].tolist() == [1, 3, 6] and table.scores[2].tolist() == [5.0, 4.0, 3.0]
    saved = table.snapshot()
    table.clear()
    table.restore(saved)
    assert table.table[2].tolist() == [1, 3, 6] and table.scores[2].tolist() == [5.0, 4.0, 3.0]


@pytest.mark.parametrize("logits, top_class", [([9.0, 1.0, 0.0], 0), ([2.0, 1.0, 0.0], 1), ([0.0, 0.0, 0.0], 1)])
def test_a_top_prediction_is_confident_only_with_most_of_the_recycled_probability(logits, top_class):
    """Class 0 needs a share of at least CONFIDENT (softmax over the stored logits: 0.9996 / 0.665 / 1/3 here);
    the second and third predictions are classes 2 and 3 whatever the shares, and the last class takes the rest."""
    table = RecycleTable(K)
    table.ensure(16, K)
    table.update(np.array([1]), np.array([[2, 3, 4]]), np.array([logits], dtype=np.float32))
    paths, classes = _paths(RecycleDrafter(table, 16, K, 3, 1), 1, [[0.5, 0.4, 0.3, 0.2]])
    assert dict(zip(map(tuple, paths), classes)) == {(2,): top_class, (3,): 2, (4,): 3}
    _, capped = _paths(RecycleDrafter(table, 16, K, 3, 1), 1, [[0.5, 0.4, 0.3]])  # three classes: 3 becomes 2
    assert sorted(capped) == sorted([top_class, 2, 2])
