"""Tests for `lookahead.suffix_cache.SuffixCache`: literal cases, LRU bounds, a brute-force model, threads."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.suffix_cache import SuffixCache


def _lists(candidates: list[np.ndarray]) -> list[list[int]]:
    return [c.tolist() for c in candidates]


@pytest.mark.parametrize("docs, text, k, max_len, expected", [
    # nothing cached, or no suffix match of min_match (2) tokens
    ([], [1, 2], 3, 4, []),
    ([[1, 2, 3, 4]], [9, 3], 3, 4, []),
    # the continuation after the match, cut to max_len and at the end of its document
    ([[1, 2, 3, 4, 5, 6]], [7, 2, 3], 3, 2, [[4, 5]]),
    ([[1, 2, 3, 4], [5, 6]], [1, 2, 3], 3, 8, [[4]]),
    # a match at a document's very end has no continuation
    ([[1, 2, 3]], [2, 3], 3, 4, []),
    # longer match first, even if older
    ([[8, 1, 2, 5, 5], [9, 1, 2, 7]], [8, 1, 2], 3, 2, [[5, 5], [7]]),
    # equal match length: newest first; a copy of a kept candidate is skipped
    ([[1, 2, 3], [1, 2, 4], [0, 1, 2, 3]], [6, 1, 2], 3, 4, [[3], [4]]),
    # a candidate that is a prefix of a kept one is skipped
    ([[1, 2, 3], [1, 2, 3, 4]], [1, 2], 3, 4, [[3, 4]]),
    # max_candidates bounds the answer
    ([[1, 2, 3], [1, 2, 4], [1, 2, 5]], [1, 2], 2, 4, [[5], [4]]),
    # matches never span two documents
    ([[1, 2], [3, 4, 5]], [2, 3, 4], 3, 4, [[5]]),
])
def test_propose_cases(docs, text, k, max_len, expected):
    cache = SuffixCache(max_tokens=100, min_match=2)
    for doc in docs:
        cache.add(doc)
    assert _lists(cache.propose(np.array(text, dtype=np.int64), k, max_len)) == expected


def test_min_match_one_and_max_match_cap():
    cache = SuffixCache(max_tokens=100, min_match=1, max_match=2)
    cache.add([5, 1, 2, 3, 7])
    cache.add([9, 2, 3, 8])
    # the matches [1, 2, 3] and [2, 3] both count as length 2 (max_match), so the newest wins
    assert _lists(cache.propose(np.array([1, 2, 3]), 2, 3)) == [[8], [7]]
    assert _lists(cache.propose(np.array([4, 3]), 3, 2)) == [[8], [7]]


def test_lru_eviction_keeps_the_token_bound_and_recently_used_documents():
    cache = SuffixCache(max_tokens=20, min_match=2)
    a, b, c = [1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28]
    cache.add(a)
    cache.add(b)
    assert len(cache) == 16 and cache.n_documents == 2
    assert _lists(cache.propose(np.array([1, 2]), 1, 2)) == [[3, 4]]  # a proposal refreshes document a
    cache.add(c)  # over the bound: the least recently used (b) goes
    assert len(cache) == 16 and cache.n_documents == 2
    assert cache.propose(np.array([11, 12]), 1, 2) == []
    assert _lists(cache.propose(np.array([1, 2]), 1, 2)) == [[3, 4]]
    assert _lists(cache.propose(np.array([21, 22]), 1, 2)) == [[23, 24]]


def test_repeat_refreshes_and_long_documents_keep_their_tail():
    cache = SuffixCache(max_tokens=10, min_match=2)
    cache.add([1, 2, 3, 4])
    cache.add([5, 6, 7, 8])
    cache.add([1, 2, 3, 4])  # exact repeat: no second copy, but now most recently used
    assert len(cache) == 8 and cache.n_documents == 2
    cache.add([9, 9, 9])  # evicts [5, 6, 7, 8], not the refreshed one
    assert cache.propose(np.array([5, 6]), 1, 2) == []
    assert _lists(cache.propose(np.array([1, 2]), 1, 2)) == [[3, 4]]
    cache.add(list(range(100, 130)))  # longer than the bound: its last 10 tokens
    assert len(cache) == 10 and cache.n_documents == 1
    assert _lists(cache.propose(np.array([120, 121]), 1, 3)) == [[122, 123, 124]]
    assert cache.propose(np.array([110, 111]), 1, 3) == []


def test_short_documents_are_ignored_and_arena_stays_bounded():
    cache = SuffixCache(max_tokens=50, min_match=2)
    cache.add([1, 2])  # too short to ever yield a draft
    assert cache.n_documents == 0
    rng = np.random.default_rng(0)
    for _ in range(300):  # many compactions and one growth
        cache.add(rng.integers(0, 1000, size=int(rng.integers(3, 30))))
        info = cache.info()
        assert info["tokens"] <= 50
        assert info["arena_slots"] <= max(1024, 2 * (50 + info["documents"] + 1))
    last = rng.integers(1000, 2000, size=12)
    cache.add(last)
    assert _lists(cache.propose(last[:4], 1, 3)) == [last[4:7].tolist()]


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"min_match": 0}, "min_match"),
    ({"min_match": 3, "max_match": 2}, "max_match"), ({"max_probes": 0}, "max_probes"),
    ({"max_tokens": 2.5}, "max_tokens"),
])
def test_constructor_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SuffixCache(**kwargs)


def test_input_errors_name_the_argument():
    cache = SuffixCache(max_tokens=10)
    with pytest.raises(ValueError, match="tokens"):
        cache.add([1, -2, 3])
    with pytest.raises(ValueError, match="tokens"):
        cache.add(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="text"):
        cache.propose(np.array([0.5, 1.0]), 1, 1)
    with pytest.raises(ValueError, match="max_candidates"):
        cache.propose(np.array([1, 2]), -1, 1)
    with pytest.raises(ValueError, match="max_len"):
        cache.propose(np.array([1, 2]), 1, 0)


class _Reference:
    """Brute-force model of `SuffixCache` (no probe cap: use a large max_probes in the cache)."""

    def __init__(self, max_tokens: int, min_match: int, max_match: int):
        self.max_tokens, self.min_match, self.max_match = max_tokens, min_match, max_match
        self.docs: OrderedDict[int, list[int]] = OrderedDict()  # LRU order; keys are insertion numbers
        self.serial = 0

    def add(self, doc: list[int]) -> None:
        doc = doc[-self.max_tokens:]
        if len(doc) <= self.min_match:
            return
        for key, cached in self.docs.items():
            if cached == doc:
                self.docs.move_to_end(key)
                return
        while sum(map(len, self.docs.values())) + len(doc) > self.max_tokens:
            self.docs.popitem(last=False)
        self.docs[self.serial] = doc
        self.serial += 1

    def propose(self, text: list[int], max_candidates: int, max_len: int) -> list[list[int]]:
        query = text[-self.max_match:]
        occurrences = []  # (match length, key, position) newest first
        for key in sorted(self.docs, reverse=True):
            doc = self.docs[key]
            for p in range(len(doc) - 2, -1, -1):
                k = 0
                while k < len(query) and k <= p and doc[p - k] == query[-1 - k]:
                    k += 1
                if k >= self.min_match:
                    occurrences.append((k, key, p))
        occurrences.sort(key=lambda o: -o[0])  # stable: newest first within a length
        out, keys = [], []
        for _, key, p in occurrences[: 0 if max_candidates == 0 else None]:
            candidate = self.docs[key][p + 1: p + 1 + max_len]
            if any(kept[: len(candidate)] == candidate for kept in out):
                continue
            out.append(candidate)
            keys.append(key)
            if len(out) == max_candidates:
                break
        for key in dict.fromkeys(keys):
            self.docs.move_to_end(key)
        return out


_docs = st.lists(st.integers(0, 3), min_size=0, max_size=14)
_ops = st.lists(st.tuples(st.booleans(), _docs, st.integers(0, 4), st.integers(1, 5)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=_ops, min_match=st.integers(1, 3), max_tokens=st.integers(8, 40))
def test_matches_brute_force_model(ops, min_match, max_tokens):
    cache = SuffixCache(max_tokens=max_tokens, min_match=min_match, max_match=6, max_probes=10_000)
    reference = _Reference(max_tokens, min_match, 6)
    for is_add, tokens, max_candidates, max_len in ops:
        if is_add:
            cache.add(tokens)
            reference.add(tokens)
            assert len(cache) == sum(map(len, reference.docs.values())) <= max_tokens
        else:
            got = _lists(cache.propose(np.array(tokens, dtype=np.int64), max_candidates, max_len))
            assert got == reference.propose(tokens, max_candidates, max_len)


def test_concurrent_add_and_propose():
    cache = SuffixCache(max_tokens=500, min_match=2)
    errors = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                doc = rng.integers(0, 50, size=int(rng.integers(3, 40)))
                cache.add(doc)
                for c in cache.propose(doc[:5], 3, 4):
                    assert 1 <= len(c) <= 4
        except Exception as exc:  # surfaced below; a thread's exception would otherwise vanish
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and len(cache) <= 500
