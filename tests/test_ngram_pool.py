"""Tests for lookahead/ngram_pool.py: literal cases, recency, dedup, eviction, memory bound, validation,
and a property test against a pure-Python reference pool."""

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.ngram_pool import NGramPool


class ReferencePool:
    """Pure-Python model of NGramPool: an LRU dict of keys, each a most-recent-first list of tuples."""

    def __init__(self, n, max_keys, per_key):
        self.n, self.max_keys, self.per_key = n, max_keys, per_key
        self.keys = OrderedDict()  # key -> [continuation tuple], most recently added-to key last

    def add(self, gram):
        key, cont = gram[0], tuple(gram[1:])
        if key in self.keys:
            self.keys.move_to_end(key)
        else:
            if len(self.keys) == self.max_keys:
                self.keys.popitem(last=False)
            self.keys[key] = []
        conts = self.keys[key]
        if cont in conts:
            conts.remove(cont)
        conts.insert(0, cont)
        del conts[self.per_key:]

    def add_text(self, tokens, start=0):
        for i in range(max(0, start - (self.n - 1)), len(tokens) - self.n + 1):
            self.add(tokens[i : i + self.n])

    def lookup(self, key, max_candidates):
        return self.keys.get(key, [])[:max_candidates]

    def __len__(self):
        return sum(len(c) for c in self.keys.values())


def as_tuples(candidates):
    for c in candidates:
        assert c.dtype == np.int64
    return [tuple(int(t) for t in c) for c in candidates]


def snapshot(pool, vocab_size):
    """Every key's full candidate list plus the size: the pool's whole observable state."""
    return len(pool), [as_tuples(pool.lookup(k, pool.per_key)) for k in range(vocab_size)]


# (n, per_key, grams added in order, {key: expected lookup(key, 8)}, expected len)
ADD_CASES = [
    (3, 8, [[1, 2, 3], [1, 4, 5], [2, 3, 4]], {1: [(4, 5), (2, 3)], 2: [(3, 4)], 0: [], 3: []}, 3),
    # re-adding a stored continuation moves it to the front instead of duplicating it
    (3, 8, [[1, 2, 3], [1, 4, 5], [1, 2, 3]], {1: [(2, 3), (4, 5)]}, 2),
    # a full key drops its oldest continuation
    (2, 2, [[1, 2], [1, 3], [1, 4]], {1: [(4,), (3,)]}, 2),
    # a refreshed continuation survives; the stale one is dropped
    (2, 2, [[1, 2], [1, 3], [1, 2], [1, 4]], {1: [(4,), (2,)]}, 2),
    (2, 1, [[5, 5], [5, 6], [6, 5]], {5: [(6,)], 6: [(5,)]}, 2),
]


@pytest.mark.parametrize("n, per_key, grams, expected, size", ADD_CASES)
def test_add_literal_cases(n, per_key, grams, expected, size):
    pool = NGramPool(n, 8, max_keys=4, per_key=per_key)
    pool.add(np.array(grams))
    for key, conts in expected.items():
        assert as_tuples(pool.lookup(key, 8)) == conts
    assert len(pool) == size


# (tokens, start, {key: expected lookup(key, 8)}) for n=3, harvested into an empty pool
ADD_TEXT_CASES = [
    ([0, 1, 2, 0, 1, 3], 0, {0: [(1, 3), (1, 2)], 1: [(2, 0)], 2: [(0, 1)], 3: []}),
    ([0, 1, 2, 0, 1, 3], 5, {0: [(1, 3)], 1: [], 2: []}),  # only the gram ending at index 5
    ([0, 1, 2, 0, 1, 3], 4, {0: [(1, 3)], 1: [], 2: [(0, 1)]}),
    ([0, 1, 2, 0, 1, 3], 6, {0: [], 1: [], 2: []}),  # start == len: nothing new
    ([0, 1], 0, {0: [], 1: []}),  # shorter than n
    ([4, 4, 4, 4], 0, {4: [(4, 4)]}),  # repeated gram stored once
]


@pytest.mark.parametrize("tokens, start, expected", ADD_TEXT_CASES)
def test_add_text_literal_cases(tokens, start, expected):
    pool = NGramPool(3, 8)
    pool.add_text(np.array(tokens), start=start)
    for key, conts in expected.items():
        assert as_tuples(pool.lookup(key, 8)) == conts


def test_lookup_truncates_most_recent_first():
    pool = NGramPool(2, 10)
    pool.add(np.array([[1, t] for t in range(2, 8)]))
    assert as_tuples(pool.lookup(1, 3)) == [(7,), (6,), (5,)]
    assert pool.lookup(1, 0) == []


def test_lookup_returns_copies():
    pool = NGramPool(3, 10)
    pool.add(np.array([[1, 2, 3]]))
    pool.lookup(1, 1)[0][:] = 9
    assert as_tuples(pool.lookup(1, 1)) == [(2, 3)]


def test_evicts_least_recently_added_key():
    pool = NGramPool(2, 10, max_keys=2, per_key=4)
    pool.add(np.array([[1, 5], [1, 6], [2, 5]]))
    pool.add(np.array([[3, 7]]))  # evicts key 1 with both its continuations
    assert pool.lookup(1, 4) == []
    assert as_tuples(pool.lookup(2, 4)) == [(5,)]
    assert as_tuples(pool.lookup(3, 4)) == [(7,)]
    assert len(pool) == 2


def test_adding_to_a_key_refreshes_it():
    pool = NGramPool(2, 10, max_keys=2, per_key=4)
    pool.add(np.array([[1, 5], [2, 5], [1, 6]]))  # key 1 is now the most recent
    pool.add(np.array([[3, 7]]))  # so key 2 goes
    assert pool.lookup(2, 4) == []
    assert as_tuples(pool.lookup(1, 4)) == [(6,), (5,)]


def test_lookup_does_not_refresh_a_key():
    pool = NGramPool(2, 10, max_keys=2, per_key=4)
    pool.add(np.array([[1, 5], [2, 5]]))
    pool.lookup(1, 4)
    pool.add(np.array([[3, 7]]))
    assert pool.lookup(1, 4) == []
    assert as_tuples(pool.lookup(2, 4)) == [(5,)]


def test_evicted_key_comes_back_empty():
    pool = NGramPool(2, 10, max_keys=1, per_key=4)
    pool.add(np.array([[1, 5], [1, 6], [2, 5], [1, 7]]))
    assert as_tuples(pool.lookup(1, 4)) == [(7,)]
    assert pool.lookup(2, 4) == []
    assert len(pool) == 1


def test_memory_is_bounded():
    n, vocab_size, max_keys, per_key = 4, 1000, 16, 3
    pool = NGramPool(n, vocab_size, max_keys=max_keys, per_key=per_key)
    ref = ReferencePool(n, max_keys, per_key)
    expected = 4 * vocab_size + max_keys * (4 * per_key * (n - 1) + 16) + 32
    assert pool.nbytes == expected
    rng = np.random.default_rng(0)
    for _ in range(20):
        grams = rng.integers(0, vocab_size, size=(200, n))
        grams[:, 0] %= 20  # 20 keys compete for 16 slots: constant eviction
        pool.add(grams)
        for gram in grams.tolist():
            ref.add(gram)
        assert pool.nbytes == expected
        assert len(pool) == len(ref) <= max_keys * per_key
    assert len(pool) > max_keys  # keys hold several continuations, so the bound is not vacuous


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 4),
    max_keys=st.integers(1, 4),
    per_key=st.integers(1, 3),
    batches=st.lists(st.lists(st.lists(st.integers(0, 5), min_size=4, max_size=4), max_size=8), max_size=6),
)
def test_matches_reference(n, max_keys, per_key, batches):
    pool = NGramPool(n, 6, max_keys=max_keys, per_key=per_key)
    ref = ReferencePool(n, max_keys, per_key)
    for batch in batches:
        grams = np.array([g[:n] for g in batch], dtype=np.int64).reshape(-1, n)
        pool.add(grams)
        for gram in grams.tolist():
            ref.add(gram)
        assert len(pool) == len(ref)
        for key in range(6):
            assert as_tuples(pool.lookup(key, per_key)) == ref.lookup(key, per_key)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 4),
    max_keys=st.integers(1, 5),
    tokens=st.lists(st.integers(0, 4), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=5),
)
def test_incremental_add_text_equals_one_shot(n, max_keys, tokens, cuts):
    text = np.array(tokens, dtype=np.int64)
    one_shot = NGramPool(n, 5, max_keys=max_keys, per_key=2)
    one_shot.add_text(text)
    incremental = NGramPool(n, 5, max_keys=max_keys, per_key=2)
    done = 0
    for cut in sorted({min(c, len(tokens)) for c in cuts} | {len(tokens)}):
        incremental.add_text(text[:cut], start=done)
        done = cut
    assert snapshot(incremental, 5) == snapshot(one_shot, 5)
    ref = ReferencePool(n, max_keys, 2)
    ref.add_text(tokens)
    assert snapshot(one_shot, 5) == (len(ref), [ref.lookup(k, 2) for k in range(5)])


# (constructor kwargs, field named in the error)
BAD_INIT = [
    (dict(n=1, vocab_size=10), "n"),
    (dict(n=2, vocab_size=0), "vocab_size"),
    (dict(n=2, vocab_size=2**31), "vocab_size"),
    (dict(n=2, vocab_size=10, max_keys=0), "max_keys"),
    (dict(n=2, vocab_size=10, per_key=0), "per_key"),
    (dict(n=2.0, vocab_size=10), "n"),
    (dict(n=True, vocab_size=10), "n"),
]


@pytest.mark.parametrize("kwargs, field", BAD_INIT)
def test_init_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        NGramPool(**kwargs)


def test_add_validation():
    pool = NGramPool(3, 10)
    for bad in ([[1, 2]], [[1, 2, 3, 4]], [1, 2, 3], [[1, 2, 10]], [[-1, 2, 3]], [[1.0, 2.0, 3.0]]):
        with pytest.raises(ValueError, match="^grams "):
            pool.add(np.array(bad))
    assert len(pool) == 0


def test_add_text_and_lookup_validation():
    pool = NGramPool(3, 10)
    for bad in ([[1, 2, 3]], [1, 2, 10], [1, -2, 3], [1.5, 2.0]):
        with pytest.raises(ValueError, match="^tokens "):
            pool.add_text(np.array(bad))
    for start in (-1, 4):
        with pytest.raises(ValueError, match="^start "):
            pool.add_text(np.array([1, 2, 3]), start=start)
    for key in (-1, 10, 1.0):
        with pytest.raises(ValueError, match="^key "):
            pool.lookup(key, 1)
    with pytest.raises(ValueError, match="^max_candidates "):
        pool.lookup(1, -1)
    assert len(pool) == 0
