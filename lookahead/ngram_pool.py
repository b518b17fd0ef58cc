"""N-gram pool: continuations keyed by their first token, bounded memory, recency-ordered.

The pool is fed n-grams harvested from the lookahead window and from committed text. For a key token it
returns the (n-1)-token continuations most recently seen after that token, which the decoder turns into
draft candidates.

Layout (all preallocated in ``NGramPool.__init__``; nothing grows afterwards):

- ``slot_of_key [vocab_size] int32``: slot holding a key's continuations, -1 if the key is absent.
- ``key_of_slot [max_keys] int32``: the key a slot holds (only meaningful for slots in use).
- ``conts [max_keys, per_key, n-1] int32``: per slot, continuations ordered most recent first.
- ``counts [max_keys] int32``: continuations stored in a slot, ``0 <= counts <= per_key``.
- ``newer / older [max_keys] int32``: a doubly linked LRU list over used slots (most recently added first).
- ``state [4] int64``: LRU head, LRU tail, slots in use, continuations stored.

The numba kernel below is a pure function of these arrays; the class only validates input and owns them.
"""

import numba
import numpy as np

from .checks import as_token_ids, check_int

# Indices into the ``state`` array shared by the kernels.
_HEAD = 0  # most recently added-to slot, -1 when empty
_TAIL = 1  # least recently added-to slot (the next to evict), -1 when empty
_USED = 2  # slots in use; slots [0, _USED) are used, so a free slot is always _USED itself
_SIZE = 3  # continuations stored over all slots (== counts.sum())

_MAX_TOKEN = np.iinfo(np.int32).max  # continuations are stored as int32


@numba.njit(cache=True)
def _add_strided(seq, start, stop, step, slot_of_key, key_of_slot, conts, counts, newer, older, state):
    """Add the n-grams ``seq[i : i+n]`` for ``i in range(start, stop, step)``, in that order (later = newer).

    ``seq`` is 1-D int64; every token is in ``[0, vocab_size)`` and every gram lies inside ``seq``.
    One loop body on purpose: numba increfs and decrefs every array passed to a jitted helper (atomic
    ops), which measured ~100 ns per gram against ~5 ns for the work itself.
    """
    max_keys, per_key, width = conts.shape
    for i in range(start, stop, step):
        key = seq[i]
        # Find the key's slot, claiming a fresh one or evicting the LRU tail, and detach it from the list.
        slot = slot_of_key[key]
        if slot < 0 and state[_USED] < max_keys:
            slot = state[_USED]  # fresh slots are not linked yet
            state[_USED] += 1
            slot_of_key[key] = slot
            key_of_slot[slot] = key
        else:
            if slot < 0:
                # All slots used: the least recently added-to key loses its slot and its continuations.
                slot = state[_TAIL]
                slot_of_key[key_of_slot[slot]] = -1
                state[_SIZE] -= counts[slot]
                counts[slot] = 0
                slot_of_key[key] = slot
                key_of_slot[slot] = key
            a, b = newer[slot], older[slot]
            if a >= 0:
                older[a] = b
            else:
                state[_HEAD] = b
            if b >= 0:
                newer[b] = a
            else:
                state[_TAIL] = a
        # The slot becomes the most recent (head of the list).
        head = state[_HEAD]
        newer[slot] = -1
        older[slot] = head
        if head >= 0:
            newer[head] = slot
        else:
            state[_TAIL] = slot
        state[_HEAD] = slot
        # Find the continuation seq[i+1 : i+n] among the slot's rows (found == count when absent).
        count = counts[slot]
        found = count
        for j in range(count):
            same = True
            for t in range(width):
                if conts[slot, j, t] != seq[i + 1 + t]:
                    same = False
                    break
            if same:
                found = j
                break
        if found == count:
            if count < per_key:
                counts[slot] = count + 1
                state[_SIZE] += 1
            else:
                found = count - 1  # a full slot drops its oldest row
        # Shift rows [0, found) one down and write row 0: rows stay most recent first, without duplicates.
        for j in range(found, 0, -1):
            for t in range(width):
                conts[slot, j, t] = conts[slot, j - 1, t]
        for t in range(width):
            conts[slot, 0, t] = seq[i + 1 + t]


class NGramPool:
    """Bounded pool of n-gram continuations keyed by the n-gram's first token.

    Each key keeps at most ``per_key`` distinct continuations (the next ``n-1`` tokens), most recently
    added first; re-adding a stored continuation moves it to the front, and adding to a full key drops
    its oldest. At most ``max_keys`` keys are held; adding a new key when all are held evicts the key
    least recently added to (``lookup`` reads only and never changes recency).

    Memory is fixed at construction: ``nbytes == 4 * vocab_size + max_keys * (4 * per_key * (n-1) + 16)
    + 32`` bytes (e.g. 9.6 MiB for ``n=5, vocab_size=152064, max_keys=65536, per_key=8``).

    Raises ValueError naming the field if ``n < 2``, ``vocab_size`` is not in ``[1, 2**31-1]``,
    ``max_keys < 1`` or ``per_key < 1``.
    """

    def __init__(self, n: int, vocab_size: int, *, max_keys: int = 65536, per_key: int = 8) -> None:
        self.n = check_int("n", n, 2)
        self.vocab_size = check_int("vocab_size", vocab_size, 1, _MAX_TOKEN)
        self.max_keys = check_int("max_keys", max_keys, 1)
        self.per_key = check_int("per_key", per_key, 1)
        self._slot_of_key = np.full(self.vocab_size, -1, dtype=np.int32)
        self._key_of_slot = np.full(self.max_keys, -1, dtype=np.int32)
        self._conts = np.zeros((self.max_keys, self.per_key, self.n - 1), dtype=np.int32)
        self._counts = np.zeros(self.max_keys, dtype=np.int32)
        self._newer = np.full(self.max_keys, -1, dtype=np.int32)
        self._older = np.full(self.max_keys, -1, dtype=np.int32)
        self._state = np.array([-1, -1, 0, 0], dtype=np.int64)
        # Warm up (compile, or load from the on-disk cache) with an empty range: no state changes.
        self._add(np.zeros(0, dtype=np.int64), 0, 0, 1)

    def _add(self, seq: np.ndarray, start: int, stop: int, step: int) -> None:
        _add_strided(seq, start, stop, step, self._slot_of_key, self._key_of_slot, self._conts,
                     self._counts, self._newer, self._older, self._state)

    @property
    def nbytes(self) -> int:
        """Total bytes of the pool's preallocated arrays (constant over the pool's life)."""
        arrays = (self._slot_of_key, self._key_of_slot, self._conts, self._counts, self._newer,
                  self._older, self._state)
        return sum(a.nbytes for a in arrays)

    def add(self, grams: np.ndarray) -> None:
        """Add n-grams in row order (a later row is more recent than an earlier one).

        ``grams``: ``[G, n]`` integer; ``grams[:, 0]`` is the key, ``grams[:, 1:]`` the continuation.
        Raises ValueError (naming ``grams``) on a wrong shape, a non-integer dtype or an out-of-range token.
        """
        arr = as_token_ids("grams", grams, 2, self.vocab_size)
        if arr.shape[1] != self.n:
            raise ValueError(f"grams must have shape [G, n={self.n}], got {arr.shape}")
        self._add(arr.reshape(-1), 0, arr.size, self.n)

    def add_text(self, tokens: np.ndarray, start: int = 0) -> None:
        """Add every n-gram ``tokens[i : i+n]`` whose last index ``i+n-1 >= start``, left to right.

        Called as ``add_text(text, start=len(text_before))`` after each commit, it adds exactly the
        n-grams a one-shot ``add_text(text)`` would have added beyond the earlier calls, in the same order.
        ``tokens``: ``[L]`` integer. Raises ValueError naming ``tokens`` (bad dtype, shape or token) or
        ``start`` (not in ``[0, L]``).
        """
        seq = as_token_ids("tokens", tokens, 1, self.vocab_size)
        start = check_int("start", start, 0, seq.shape[0])
        self._add(seq, max(0, start - (self.n - 1)), seq.shape[0] - self.n + 1, 1)

    def lookup(self, key: int, max_candidates: int) -> list[np.ndarray]:
        """Return up to ``max_candidates`` distinct continuations of ``key``, most recent first.

        Each is an ``[n-1]`` int64 array (a row of a copy, never aliasing the pool); an unknown key gives
        ``[]``. Raises ValueError naming ``key`` (not in ``[0, vocab_size)``) or ``max_candidates`` (< 0).
        """
        key = check_int("key", key, 0, self.vocab_size - 1)
        max_candidates = check_int("max_candidates", max_candidates, 0)
        slot = self._slot_of_key[key]
        if slot < 0:
            return []
        rows = self._conts[slot, : min(int(self._counts[slot]), max_candidates)].astype(np.int64)
        return list(rows)

    def __len__(self) -> int:
        """Number of continuations stored over all keys."""
        return int(self._state[_SIZE])
