"""`SuffixCache`: a bounded, thread-safe cache of recent documents (prompt + output token sequences) that
drafts continuations of the current text from earlier requests (a `drafters.SharedDrafter`).

Code-completion clients re-send almost the same file on every keystroke, so the continuation of the current
text's suffix in an earlier request's prompt or output is a good draft. Documents live in one token arena,
each followed by a separator (-1) so that no match or continuation crosses a document boundary:

    arena:  [ doc A ........ | -1 | doc B ..... | -1 | (evicted: all -1) | -1 | doc C ... | -1 | free ... ]

The arena is indexed by its ``min_match``-grams with the hash-chain index of `suffix_index.py` (a chain runs
from the newest occurrence backwards; grams holding a separator are not indexed). Evicting a document
overwrites its tokens with -1: chains still pass through its positions, but no query matches there.
When the arena is full, live documents are compacted to its front and the index is rebuilt (amortized O(1)
per token, as at most half of the arena is dead when that happens after a growth).

The numba kernels are pure functions of these arrays; the class validates input, owns the arrays, keeps the
LRU order of documents and serializes access with a lock.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numba
import numpy as np

from .checks import as_token_ids, check_int
from .suffix_index import gram_bucket, index_range, rank_candidates, table_bits

_FREE = -1  # separator / evicted / unused arena slot; never a token id


@numba.njit(cache=True)
def _search(tokens, m, bits, head, prev, query, max_probes, occ_pos, occ_len, out, out_len, out_first,
            out_match):
    """Fill ``out[:c], out_len[:c], out_first[:c]`` with ranked candidates (see `SuffixCache.propose`); return c.

    query: [q] the text's last tokens (q = the longest match considered); out: [max_candidates, max_len];
    out_first: arena position of each candidate's first token; out_match: its match length; occ_pos / occ_len:
    scratch of >= max_probes.
    """
    q = query.shape[0]
    if out.shape[0] == 0 or q < m:
        return 0
    # Hash the query's last m tokens exactly as the index hashes an arena gram.
    shift = np.uint64(64 - bits)
    b = gram_bucket(query, q - 1, m, shift)
    # Pass 1: up to max_probes occurrences, newest first, with their match length (>= m filters collisions).
    n_occ = 0
    p = head[b]
    probes = 0
    while p >= 0 and probes < max_probes:
        probes += 1
        k = 0
        while k < q and k <= p and tokens[p - k] == query[q - 1 - k]:
            k += 1
        if k >= m and tokens[p + 1] >= 0:  # the arena always ends with a free slot: p + 1 is in range
            occ_pos[n_occ] = p
            occ_len[n_occ] = k
            n_occ += 1
        p = prev[p]
    return rank_candidates(tokens, tokens.shape[0], occ_pos, occ_len, n_occ, q, m, out, out_len, out_first,
                           out_match)


@dataclass
class _Document:
    """Where one cached document sits in the arena: tokens ``[start, start + length)``, then a separator."""

    start: int
    length: int
    digest: bytes


class SuffixCache:
    """Cross-request drafter over recently seen documents (prompt + output token sequences).

    ``add(tokens)`` stores a document, evicting least recently used documents while more than ``max_tokens``
    tokens would be cached (a document longer than that keeps its last ``max_tokens`` tokens; an exact repeat
    of a cached document only refreshes it). ``propose(text, ...)`` drafts continuations of ``text``'s suffix
    (see its docstring); a document a proposal comes from becomes the most recently used. Memory: the arena
    holds at most ``2 * (max_tokens + documents + 1)`` slots (int64 token, int64 owner, int32 chain link
    each) plus a hash table of at most 4 int32 per slot. All methods are thread-safe.

    min_match: shortest suffix match that yields a draft (also the index's gram size), max_match: longest match
    compared when ranking, max_probes: occurrences examined per proposal (newest first). Raises ValueError
    naming the field for ``max_tokens < 1``, ``min_match < 1``, ``max_match < min_match``, ``max_probes < 1``.
    """

    def __init__(self, max_tokens: int = 1 << 16, min_match: int = 2, max_match: int = 32,
                 max_probes: int = 256) -> None:
        self.max_tokens = check_int("max_tokens", max_tokens, 1)
        self.min_match = check_int("min_match", min_match, 1)
        self.max_match = check_int("max_match", max_match, self.min_match)
        self.max_probes = check_int("max_probes", max_probes, 1)
        self._lock = threading.Lock()
        self._docs: OrderedDict[int, _Document] = OrderedDict()  # LRU first, most recent last
        self._by_digest: dict[bytes, int] = {}
        self._next_id = 0
        self._live = 0  # tokens of cached documents
        self._used = 0  # arena slots in use (live and dead documents with their separators)
        self._occ_pos = np.zeros(self.max_probes, dtype=np.int64)  # [max_probes] search scratch
        self._occ_len = np.zeros(self.max_probes, dtype=np.int64)  # [max_probes] search scratch
        self._allocate(1024)
        self._index(0, 0)  # compile (or load) the kernels once, on the empty arena
        self.propose(np.zeros(self.min_match, dtype=np.int64), 1, 1)

    def add(self, tokens: np.ndarray | list[int]) -> None:
        """Cache a document (``[n]`` token ids, e.g. a request's prompt + output) as the most recently used.

        Documents shorter than ``min_match + 1`` tokens are ignored (they cannot yield a draft).
        Raises ValueError naming ``tokens`` if it is not 1-D integer token ids (>= 0).
        """
        doc = as_token_ids("tokens", tokens)[-self.max_tokens:]
        if doc.shape[0] <= self.min_match:
            return
        digest = hashlib.blake2b(doc.tobytes(), digest_size=16).digest()
        with self._lock:
            if digest in self._by_digest:
                self._docs.move_to_end(self._by_digest[digest])
                return
            while self._live + doc.shape[0] > self.max_tokens:
                self._evict(next(iter(self._docs)))
            self._reserve(doc.shape[0] + 1)
            start = self._used
            self._tokens[start: start + doc.shape[0]] = doc
            self._owner[start: start + doc.shape[0]] = self._next_id
            self._index(start, start + doc.shape[0])
            self._docs[self._next_id] = _Document(start, doc.shape[0], digest)
            self._by_digest[digest] = self._next_id
            self._next_id += 1
            self._used += doc.shape[0] + 1
            self._live += doc.shape[0]

    def propose(self, text: np.ndarray, max_candidates: int, max_len: int) -> list[np.ndarray]:
        """Return up to ``max_candidates`` continuations of ``text`` (``[n]`` int64, ending with the root),
        each a ``[1..max_len]`` int64 array, best first.

        An occurrence is a cached position where the last ``k >= min_match`` tokens of ``text`` end (``k`` up to
        ``max_match``, compared backwards within one document); its candidate is the at most ``max_len``
        tokens that follow it in that document. Among the ``max_probes`` newest occurrences, candidates rank by
        ``k``, longest first, then newest first; a candidate equal to or a prefix of a kept one is skipped.
        Raises ValueError naming ``text``, ``max_candidates`` (< 0) or ``max_len`` (< 1).
        """
        query = as_token_ids("text", text)[-self.max_match:]
        max_candidates = check_int("max_candidates", max_candidates, 0)
        max_len = check_int("max_len", max_len, 1)
        out = np.empty((max_candidates, max_len), dtype=np.int64)  # [max_candidates, max_len]
        out_len = np.empty(max_candidates, dtype=np.int64)  # [max_candidates]
        out_first = np.empty(max_candidates, dtype=np.int64)  # [max_candidates] arena positions
        out_match = np.empty(max_candidates, dtype=np.int64)  # [max_candidates] (unused here)
        with self._lock:
            count = _search(self._tokens, self.min_match, self._bits, self._head, self._prev, query,
                            self.max_probes, self._occ_pos, self._occ_len, out, out_len, out_first, out_match)
            for doc_id in dict.fromkeys(self._owner[out_first[:count]].tolist()):
                self._docs.move_to_end(doc_id)
        return [out[i, :n] for i, n in enumerate(out_len[:count].tolist())]

    def __len__(self) -> int:
        """Number of cached tokens (separators and evicted documents excluded)."""
        return self._live

    @property
    def n_documents(self) -> int:
        """Number of cached documents."""
        return len(self._docs)

    def info(self) -> dict:
        """JSON-ready occupancy: documents, cached tokens, the token bound and the arena size in slots."""
        with self._lock:
            return {"documents": len(self._docs), "tokens": self._live, "max_tokens": self.max_tokens,
                    "arena_slots": int(self._tokens.shape[0]) - 1}

    # -- arena management (callers hold the lock) ----------------------------------------------------------

    def _allocate(self, capacity: int) -> None:
        """Fresh arena of ``capacity`` slots (all free) and an empty index; forgets every document."""
        self._tokens = np.full(capacity + 1, _FREE, dtype=np.int64)  # [capacity + 1]; last slot stays free
        self._owner = np.full(capacity + 1, -1, dtype=np.int64)  # [capacity + 1] document id per slot
        self._bits = table_bits(capacity)  # >= 2 buckets per slot: load factor <= 1/2
        self._head = np.full(1 << self._bits, -1, dtype=np.int32)  # [2**bits] newest position per bucket
        self._prev = np.full(capacity + 1, -1, dtype=np.int32)  # [capacity + 1] previous position in bucket
        self._used = 0

    def _index(self, start: int, stop: int) -> None:
        index_range(self._tokens, start, stop, self.min_match, self._bits, self._head, self._prev)

    def _evict(self, doc_id: int) -> None:
        """Drop a document: its slots become free (dead until the next compaction)."""
        doc = self._docs.pop(doc_id)
        del self._by_digest[doc.digest]
        self._tokens[doc.start: doc.start + doc.length] = _FREE
        self._live -= doc.length

    def _reserve(self, slots: int) -> None:
        """Make room for ``slots`` more slots at the end of the arena: compact, growing it if needed."""
        capacity = self._tokens.shape[0] - 1
        if self._used + slots <= capacity:
            return
        needed = self._live + len(self._docs) + slots  # live documents with their separators, plus the new one
        # At least half the arena is free after compaction, so compactions cost amortized O(1) per token.
        self._compact(max(capacity, 2 * needed))

    def _compact(self, capacity: int) -> None:
        """Move live documents (in arena order) to the front of a new arena of ``capacity`` slots; re-index."""
        tokens, owner = self._tokens, self._owner
        docs = sorted(self._docs.items(), key=lambda item: item[1].start)
        self._allocate(capacity)
        for doc_id, doc in docs:
            stop = self._used + doc.length
            self._tokens[self._used: stop] = tokens[doc.start: doc.start + doc.length]
            self._owner[self._used: stop] = owner[doc.start: doc.start + doc.length]
            doc.start = self._used
            self._used = stop + 1
        self._index(0, self._used)
