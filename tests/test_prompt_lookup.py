"""Tests for lookahead/prompt_lookup.py: literal cases, buffer growth, validation, and a property test
against a brute-force reference of the ranking documented in ``PromptLookup``."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.prompt_lookup import PromptLookup


def reference_propose(text, min_ngram, max_ngram, max_candidates, max_len):
    """Brute force over every end position, mirroring the PromptLookup docstring word for word."""
    length = len(text)
    occurrences = []  # (match length, end position)
    for p in range(length - 1):
        k = 0
        while k < max_ngram and k <= p and text[p - k] == text[length - 1 - k]:
            k += 1
        if k >= min_ngram:
            occurrences.append((k, p))
    occurrences.sort(key=lambda kp: (-kp[0], -kp[1]))
    kept = []
    for _, p in occurrences:
        if len(kept) == max_candidates:
            break
        cand = tuple(text[p + 1 : min(p + 1 + max_len, length)])
        if not any(c[: len(cand)] == cand for c in kept):
            kept.append(cand)
    return kept


def as_tuples(candidates):
    for c in candidates:
        assert c.dtype == np.int64 and c.ndim == 1
    return [tuple(int(t) for t in c) for c in candidates]


def propose(text, max_candidates=8, max_len=3, max_ngram=4, min_ngram=1):
    drafter = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram)
    drafter.extend(text)
    return as_tuples(drafter.propose(max_candidates, max_len).paths)


# (text, propose kwargs, expected candidates)
CASES = [
    ([], {}, []),
    ([7], {}, []),
    ([7, 7], {}, [(7,)]),
    ([1, 2, 3], {}, []),  # the suffix never occurred before
    # two 3-token matches: the more recent first
    ([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], dict(max_len=3), [(5, 1, 2), (4, 1, 2)]),
    # a longer match beats a more recent shorter one
    ([9, 2, 3, 4, 1, 2, 5, 8, 9, 2], dict(max_len=2), [(3, 4), (5, 8)]),
    # continuations stop at the end of the text
    ([5, 6, 5], dict(max_len=4), [(6, 5)]),
    # a periodic text: the truncated most recent continuation ranks first, the longer one it prefixes stays
    ([1, 2, 1, 2, 1, 2], dict(max_len=3), [(1, 2), (1, 2, 1)]),
    ([1, 2, 1, 2, 1, 2, 1, 2], dict(max_len=3), [(1, 2), (1, 2, 1)]),
    # identical continuations are returned once
    ([1, 2, 1, 2, 1, 2, 1, 2, 1, 2], dict(max_len=2), [(1, 2)]),
    # min_ngram=2: a single-token match does not qualify
    ([4, 1, 5, 1], dict(min_ngram=2), []),
    ([4, 1, 5, 1], dict(min_ngram=1), [(5, 1)]),
    # max_ngram caps the match length, so recency decides between two full-length matches
    ([3, 1, 2, 8, 4, 1, 2, 9, 3, 1, 2], dict(max_ngram=2, max_len=1), [(9,), (8,)]),
    ([3, 1, 2, 8, 4, 1, 2, 9, 3, 1, 2], dict(max_ngram=3, max_len=1), [(8,), (9,)]),
    # max_candidates truncates after the ranking
    ([1, 2, 1, 3, 1, 4, 1], dict(max_len=1), [(4,), (3,), (2,)]),
    ([1, 2, 1, 3, 1, 4, 1], dict(max_len=1, max_candidates=2), [(4,), (3,)]),
    ([1, 2, 1, 3, 1, 4, 1], dict(max_len=1, max_candidates=0), []),
    # a candidate that is a prefix of a kept one is dropped: (1,) after (1, 5, 1)
    ([1, 1, 1, 5, 1, 1], dict(max_len=3), [(5, 1, 1), (1, 5, 1), (1, 1, 5)]),
    # same first token, different sequences: both kept, the more recent first
    ([1, 5, 1, 5, 6, 1], dict(max_len=3), [(5, 6, 1), (5, 1, 5)]),
    ([1, 5, 6, 1, 5, 1], dict(max_len=3), [(5, 1), (5, 6, 1)]),
]


@pytest.mark.parametrize("text, kwargs, expected", CASES)
def test_literal_cases(text, kwargs, expected):
    assert propose(text, **kwargs) == expected
    assert reference_propose(text, kwargs.get("min_ngram", 1), kwargs.get("max_ngram", 4),
                             kwargs.get("max_candidates", 8), kwargs.get("max_len", 3)) == expected


def test_large_token_ids():
    text = [151_000, 2**40, 7, 151_000, 2**40]
    assert propose(text) == [(7, 151_000, 2**40)]


def test_growth_keeps_text_and_index():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 5, size=300)
    drafter = PromptLookup(capacity=1)
    for chunk in np.array_split(text, 37):
        drafter.extend(chunk)
    assert len(drafter) == 300
    assert as_tuples(drafter.propose(6, 5).paths) == reference_propose(text.tolist(), 1, 4, 6, 5)


def test_propose_does_not_alias_the_text():
    drafter = PromptLookup()
    drafter.extend([1, 2, 3, 1])
    drafter.propose(1, 3).paths[0][:] = 9
    assert as_tuples(drafter.propose(1, 3).paths) == [(2, 3, 1)]



def test_propose_returns_each_candidates_match_length():
    drafter = PromptLookup()
    drafter.extend([5, 1, 2, 9, 7, 2, 4, 1, 2])
    found = drafter.propose(4, 3)
    assert as_tuples(found.paths) == [(9, 7, 2), (4, 1, 2)] and found.match_lengths.tolist() == [2, 1]
    assert drafter.propose(0, 3).match_lengths.tolist() == []

def test_extend_accepts_lists_arrays_and_empty():
    drafter = PromptLookup()
    drafter.extend([])
    drafter.extend(np.array([], dtype=np.int64))
    drafter.extend([3, 4])
    drafter.extend(np.array([3], dtype=np.uint16))
    assert len(drafter) == 3
    assert as_tuples(drafter.propose(2, 2).paths) == [(4, 3)]


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(4, 6),
    min_ngram=st.integers(1, 3),
    extra_ngram=st.integers(0, 3),
    capacity=st.integers(1, 8),
    max_candidates=st.integers(0, 6),
    max_len=st.integers(1, 6),
)
def test_matches_reference(data, vocab, min_ngram, extra_ngram, capacity, max_candidates, max_len):
    text = data.draw(st.lists(st.integers(0, vocab - 1), max_size=60), label="text")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6), label="cuts"))
    max_ngram = min_ngram + extra_ngram
    drafter = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram, capacity=capacity)
    done = 0
    for cut in cuts + [len(text)]:
        drafter.extend(text[done:cut])
        done = cut
        got = as_tuples(drafter.propose(max_candidates, max_len).paths)
        assert got == reference_propose(text[:cut], min_ngram, max_ngram, max_candidates, max_len)
        assert len(drafter) == cut


# (constructor kwargs, field named in the error)
BAD_INIT = [
    (dict(min_ngram=0), "min_ngram"),
    (dict(min_ngram=3, max_ngram=2), "max_ngram"),
    (dict(capacity=0), "capacity"),
    (dict(max_ngram=2.0), "max_ngram"),
    (dict(min_ngram=True), "min_ngram"),
]


@pytest.mark.parametrize("kwargs, field", BAD_INIT)
def test_init_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        PromptLookup(**kwargs)


def test_extend_and_propose_validation():
    drafter = PromptLookup()
    too_big = np.array([2**63], dtype=np.uint64)
    for bad in ([[1, 2]], [1, -1], [1.0, 2.0], np.array([True, False]), 5, too_big):
        with pytest.raises(ValueError, match="^tokens "):
            drafter.extend(bad)
    assert len(drafter) == 0
    with pytest.raises(ValueError, match="^max_candidates "):
        drafter.propose(-1, 2)
    with pytest.raises(ValueError, match="^max_len "):
        drafter.propose(1, 0)
