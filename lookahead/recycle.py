"""Token recycling: the target's own top-k next tokens, kept per token from every verification forward and grown
into a draft tree from the root (Luo et al., "Turning Trash into Treasure", ACL 2025).

Every step's forward already computes the logits of every verified row, including the rejected ones. For the
token t a row carries, the row's top-k tokens are what the target expects after t (in that row's context); the
adjacency table keeps them, one row per token id:

    table [vocab, k] int32: table[t, r] = the r-th most likely next token the last time a row carrying t was
                            verified (-1 = t never verified)
    scores [vocab, k] float32: scores[t, r] = that token's raw logit in that row

A step overwrites the table rows of every token it verified, the accepted path last, so for a token verified
twice in one step the prediction with the true context wins. A draft is grown from the root best-first over
the table: a node's children are its token's table row, and a child of class c at depth d is worth its parent's
value times the estimated probability `value[d - 1, c]` that such a node is accepted once its parent is (the
planner's learned estimate for recycled nodes of that class). A child's class says how much the target trusted
it: 0 for the top-1 prediction when it held at least `CONFIDENT` of the row's recycled probability (the softmax
of the stored logits over the stored children), 1 for a less confident top-1, then 2, 3, … for the second,
third, … prediction (capped at the last class). The `max_nodes` most valuable nodes form the draft, so its shape
(wide near the root, deep along confident chains) follows what is accepted, not a fixed template. Under seeded
sampling a child's place is instead its place under the noise the seeded draw will add at its index
(`draft_noise.py`): children ordered by recycled logit / temperature + noise, as the draw orders them.

With pair rows (`recycle_pairs.py`, opt-in: `LookaheadConfig.recycle_pairs`) the table also keeps each verified
row's top-k under the pair (the token before t, t), and a node's children are those of its pair's row (when one
is kept) and of its token's row, each family with its own classes: `value` then has a column per class for token
rows, for verified pair rows and for seeded pair rows (`_grow`).

Memory: `vocab × k` int32 + float32 (49152 × 8 → 3 MB), and with pair rows 9 MB more. One table can serve many
generations (a `Lookahead` object's calls, a server's requests); all methods are thread-safe.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple

import numba
import numpy as np

from .gumbel import gumbel_of
from .recycle_pairs import PAIR_SLOTS, empty_pairs, find_pair, pair_keys, place_pair, seed_pairs

if TYPE_CHECKING:  # recycle_prior imports what the head files need; the table only reads a prior's arrays
    from .recycle_prior import RecyclePrior

# A first-placed child holding at least this share of its row's recycled probability is "confident" (class 0).
# Measured on the default model (greedy, 4 prompts each of chat / code / summarization, 96 tokens): the recycled
# top-1 was the next token 12-24% of the time when its share was 0.2-0.4, 33-40% at 0.8-0.9 and 49-60% above 0.9.
CONFIDENT = 0.85


@numba.njit(cache=True, nogil=True)
def _row_top_k(row, indices, values):  # pragma: no cover - compiled
    """The k = indices.shape[0] largest logits of `row` [V] float32, best first (ties: lower token id first), into
    indices [k] int64 and values [k] float32 (-1 / -inf where fewer than k are not NaN): one pass keeping the k best
    so far. Returns whether the row holds no NaN."""
    k = indices.shape[0]
    for j in range(k):
        values[j], indices[j] = -np.inf, -1
    low, nan_free = -np.inf, True
    for v in range(row.shape[0]):
        a = row[v]
        if a > low:
            j = k - 1
            while j > 0 and values[j - 1] < a:
                values[j], indices[j] = values[j - 1], indices[j - 1]
                j -= 1
            values[j], indices[j] = a, v
            low = values[k - 1]
        elif not a <= low:  # neither above nor at most: NaN
            nan_free = False
    return nan_free


@numba.njit(cache=True, nogil=True, parallel=True)
def _top_k_rows(logits, indices, values, nan_free):  # pragma: no cover - compiled
    """Each row's k = indices.shape[1] largest logits (`_row_top_k`) into indices [n, k] and values [n, k], the rows
    in parallel (a step's rows: about half the one-thread time on 2 cores at 8 rows), and nan_free [n] whether each
    row holds no NaN."""
    for r in numba.prange(logits.shape[0]):
        nan_free[r] = _row_top_k(logits[r], indices[r], values[r])


class RowTops(NamedTuple):
    """Each verified row's k largest logits, best first (`top_k`)."""

    indices: np.ndarray  # [n, k] int64, ties to the lower token id; -1 past the row's non-NaN logits
    values: np.ndarray  # [n, k] float32
    nan_free: np.ndarray  # [n] bool: the row holds no NaN (then indices[:, 0], when not -1, is torch's argmax)


def top_k(logits, k: int) -> RowTops:
    """Each row's k largest logits, best first, for logits [n, V] (torch): `_top_k_rows` for float32 CPU rows,
    `torch.topk` for anything else."""
    import torch

    if logits.dtype == torch.float32 and logits.device.type == "cpu" and not logits.requires_grad:
        n = logits.shape[0]
        tops = RowTops(np.empty((n, k), np.int64), np.empty((n, k), np.float32), np.empty(n, np.bool_))
        _top_k_rows(logits.contiguous().numpy(), *tops)
        return tops
    top = torch.topk(logits, k, dim=-1)
    nan_free = ~torch.isnan(logits).any(dim=-1).cpu().numpy()
    return RowTops(top.indices.cpu().numpy(), top.values.float().cpu().numpy(), nan_free)


@numba.njit(cache=True)
def _update(table, scores, pkeys, pnext, pscores, pseeded, tokens, keys, topk, values):
    """table[tokens[i]] = topk[i] and scores[tokens[i]] = values[i] for i in order (a later row wins for a
    repeated token), and the same row for the pair `keys[i]` (`recycle_pairs`; -1: none) in the pair table; rows
    are cut or padded (-1, score 0) to the table's k, tokens outside the table are skipped and predictions
    outside it stored as -1.

    table: [vocab, k] int32; scores: [vocab, k] float32; pkeys / pnext / pscores: the pair table ([S] int64,
    [S, k] int32, [S, k] float32, and pseeded [S] bool, cleared for every row written here; S = 0: none); tokens,
    keys: [n] int64; topk: [n, m] int64; values: [n, m] float32."""
    vocab, k = table.shape
    width = min(k, topk.shape[1])
    for i in range(tokens.shape[0]):
        t = tokens[i]
        if t < 0 or t >= vocab:
            continue
        slot = place_pair(pkeys, keys[i], True)
        if slot >= 0:
            pseeded[slot] = False
        for r in range(k):
            token = topk[i, r] if r < width else -1
            inside = 0 <= token < vocab
            table[t, r] = token if inside else -1
            scores[t, r] = values[i, r] if r < width else 0.0
            if slot >= 0:
                pnext[slot, r], pscores[slot, r] = table[t, r], scores[t, r]


@numba.njit(cache=True)
def _child_places(row_tokens, row_scores, noise, inv_temp, depth, out, keys):
    """out[r] = the place of row_tokens[r] among a node's children (one row of them, `_children`) at depth `depth`: r
    itself, or, when `noise` [Dn] uint64 has a key for that depth (key depth - 1), its place by row_scores *
    inv_temp + that index's Gumbel noise (`gumbel.gumbel_of`) — the order of the seeded rule's Gumbel-max draw at
    that index, as far as the recycled top-k logits tell. keys: [k] float64 scratch."""
    k = row_tokens.shape[0]
    row = depth - 1
    for r in range(k):
        out[r] = r
    if row >= noise.shape[0]:
        return
    for r in range(k):
        c = row_tokens[r]
        keys[r] = -np.inf
        if c >= 0:
            keys[r] = row_scores[r] * inv_temp + gumbel_of(noise[row], c)
    for r in range(k):
        if row_tokens[r] < 0:
            continue
        place = 0
        for r2 in range(k):
            if r2 != r and row_tokens[r2] >= 0 and (keys[r2] > keys[r] or (keys[r2] == keys[r] and r2 < r)):
                place += 1
        out[r] = place


@numba.njit(cache=True)
def _child_classes(row_tokens, row_scores, noise, inv_temp, depth, classes, out, keys):
    """out[r] = the class of row_tokens[r] among a node's children at depth `depth` (the module docstring): 0 for
    the first-placed child (`_child_places`) when its share of the row's recycled probability (softmax of the
    stored logits over the stored children) is at least CONFIDENT, 1 for the first-placed child otherwise, then
    2, 3, … by place, capped at `classes` - 1."""
    _child_places(row_tokens, row_scores, noise, inv_temp, depth, out, keys)
    k = row_tokens.shape[0]
    top, total = -np.inf, 0.0
    for r in range(k):
        if row_tokens[r] >= 0:
            top = max(top, np.float64(row_scores[r]))
    for r in range(k):
        if row_tokens[r] >= 0:
            total += np.exp(np.float64(row_scores[r]) - top)
    for r in range(k):
        if row_tokens[r] < 0:
            continue
        if out[r] == 0:
            out[r] = 0 if np.exp(np.float64(row_scores[r]) - top) >= CONFIDENT * total else 1
        else:
            out[r] = out[r] + 1
        out[r] = min(out[r], classes - 1)


@numba.njit(cache=True)
def _children(table, scores, pkeys, pnext, pscores, pseeded, noise, inv_temp, prev, token, depth, classes,
              out_tokens, out_classes, row_tokens, row_scores, places, place_keys):
    """The children of a node carrying `token` after the token `prev` at depth `depth`, into out_tokens /
    out_classes ([2k]); returns their count. First the pair row of (prev, token) when the pair table holds one,
    each child of class C + c (`_child_classes`, C = `classes`; 2C + c for a row seeded from a prior), then the
    token's own row, each child not already listed of class c: both rows' predictions are proposed, each valued
    by its own class's acceptance."""
    n = 0
    vocab, k = table.shape
    slot = find_pair(pkeys, prev * vocab + token) if 0 <= prev < vocab else -1
    for paired in (True, False):
        if paired and slot < 0:
            continue
        for r in range(k):
            row_tokens[r] = pnext[slot, r] if paired else table[token, r]
            row_scores[r] = pscores[slot, r] if paired else scores[token, r]
        _child_classes(row_tokens, row_scores, noise, inv_temp, depth, classes, places, place_keys)
        listed = n
        for r in range(k):
            child = row_tokens[r]
            if child < 0:
                continue
            seen = False
            for j in range(listed):
                seen = seen or out_tokens[j] == child
            if not seen:
                kind = (2 if pseeded[slot] else 1) if paired else 0
                out_tokens[n], out_classes[n] = child, places[r] + kind * classes
                n += 1
    return n


@numba.njit(cache=True)
def _grow(table, scores, pkeys, pnext, pscores, pseeded, noise, inv_temp, prev, root, value, max_nodes, max_depth,
          paths, depth, rank, parent, score, f_parent, f_token, f_rank, f_score, out_tokens, out_classes, row_tokens,
          row_scores, places, place_keys):
    """Best-first growth of a draft tree from `root` (after the token `prev`, -1: unknown) over `table` and the
    pair table (`_children`: a node's children are those of its pair row, with its parent's token, and of its
    token's row); returns the node count n <= max_nodes.

    value: [D, 3C] float64, conditional acceptance of a node at depth d (row d - 1, last row for deeper ones) of
    class c < C (`_child_classes`: from its place — its top-k column, or its place under the seeded draw's noise
    when `noise` ([Dn] uint64 keys) has a key for its depth — and its share of the recycled probability; scores
    [vocab, k] float32 the recycled logits) in column c when it comes from a token's row, C + c from a verified
    pair's row, 2C + c from a seeded pair's row; max_depth <= paths.shape[1]. Writes, per node in selection order
    (a parent before its children): paths[i, :depth[i]] its tokens from the root's child down to it, depth[i],
    rank[i] its column of `value`, parent[i] (-1 = the root), score[i] (product of the values along its path).
    f_parent / f_token / f_rank / f_score: frontier scratch of at least (max_nodes + 1) * 2k entries; out_tokens,
    out_classes: [2k] scratch; row_tokens, row_scores, places, place_keys: [k] scratch.
    """
    n_front = 0
    classes = value.shape[1] // 3
    m = _children(table, scores, pkeys, pnext, pscores, pseeded, noise, inv_temp, prev, root, 1, classes, out_tokens,
                  out_classes, row_tokens, row_scores, places, place_keys)
    for j in range(m):  # the root's children
        f_parent[n_front], f_token[n_front], f_rank[n_front] = -1, out_tokens[j], out_classes[j]
        f_score[n_front] = value[0, out_classes[j]]
        n_front += 1
    n = 0
    while n < max_nodes and n_front > 0:
        best = 0
        for j in range(1, n_front):
            if f_score[j] > f_score[best]:
                best = j
        p, token, r, s = f_parent[best], f_token[best], f_rank[best], f_score[best]
        n_front -= 1  # remove `best`, keeping insertion order: ties go to the earlier (shallower, better-ranked)
        for j in range(best, n_front):
            f_parent[j], f_token[j] = f_parent[j + 1], f_token[j + 1]
            f_rank[j], f_score[j] = f_rank[j + 1], f_score[j + 1]
        d = 1 if p < 0 else depth[p] + 1
        for j in range(d - 1):
            paths[n, j] = paths[p, j]
        paths[n, d - 1] = token
        depth[n], rank[n], parent[n], score[n] = d, r, p, s
        if d < max_depth:
            row = min(d, value.shape[0] - 1)
            before = root if d == 1 else paths[n, d - 2]
            m = _children(table, scores, pkeys, pnext, pscores, pseeded, noise, inv_temp, before, token, d + 1,
                          classes, out_tokens, out_classes, row_tokens, row_scores, places, place_keys)
            for j in range(m):
                f_parent[n_front], f_token[n_front], f_rank[n_front] = n, out_tokens[j], out_classes[j]
                f_score[n_front] = s * value[row, out_classes[j]]
                n_front += 1
        n += 1
    return n


class RecycleTable:
    """The adjacency table of recycled top-k predictions (see the module docstring), shareable and thread-safe.

    Beside each stored next token it keeps that token's raw logit in the row that predicted it (`scores`), so a
    seeded draft can order a node's children as the seeded draw would. Beside the rows per token it keeps rows
    per token pair in a table of `pair_slots` slots (`recycle_pairs.py`; 0: none, else a power of two), which a
    draft consults first. The table is allocated for a vocabulary on first use (`ensure`); a call with another
    vocabulary size or k starts a fresh table. Raises `ValueError` naming `k` unless 1 <= k <= 64, or for pair
    slots that are not 0 or a power of two.
    """

    def __init__(self, k: int = 8, pair_slots: int = 0):
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
            raise ValueError(f"k must be an int in [1, 64], got {k!r}")
        self.k, self.pair_slots = k, pair_slots
        self._lock = threading.Lock()
        self.table = np.full((0, k), -1, dtype=np.int32)  # [vocab, k]
        self.scores = np.zeros((0, k), dtype=np.float32)  # [vocab, k] raw logits of the stored tokens
        self.pairs = empty_pairs(pair_slots, k)  # (keys [S], next, scores [S, k], seeded [S]): rows per token pair
        # Compile (or load from numba's disk cache) both kernels once, on a one-token table.
        warm = np.full((1, 1), -1, dtype=np.int32)
        _update(warm, np.zeros((1, 1), np.float32), *empty_pairs(1, 1), np.zeros(1, np.int64),
                np.full(1, -1, np.int64), np.zeros((1, 1), np.int64), np.zeros((1, 1), np.float32))
        _Grower(1, 1, 1).grow(warm, np.zeros((1, 1), np.float32), empty_pairs(1, 1), -1, 0, np.ones((1, 3)),
                              NO_NOISE, 1.0)

    @classmethod
    def for_config(cls, config) -> "RecycleTable":
        """An empty table as a `LookaheadConfig` asks for: `recycle_k` wide, with pair rows when
        `recycle_pairs`."""
        return cls(config.recycle_k, PAIR_SLOTS if config.recycle_pairs else 0)

    def ensure(self, vocab_size: int, k: int) -> None:
        """Make the table `[vocab_size, k]`, forgetting what it held if its shape changes."""
        with self._lock:
            if self.table.shape != (vocab_size, k):
                self.k = k
                self.table = np.full((vocab_size, k), -1, dtype=np.int32)
                self.scores = np.zeros((vocab_size, k), dtype=np.float32)
                self.pairs = empty_pairs(self.pair_slots, k)

    def clear(self) -> None:
        """Forget every recycled prediction (the shape stays)."""
        with self._lock:
            self.table.fill(-1)
            self.scores.fill(0.0)
            self.pairs = empty_pairs(self.pair_slots, self.k)

    def snapshot(self) -> tuple:
        """A copy of the table, its scores and its pair rows, for `restore`."""
        with self._lock:
            return self.table.copy(), self.scores.copy(), tuple(a.copy() for a in self.pairs)

    def restore(self, state: tuple) -> None:
        """Put back a `snapshot` (its shape becomes the table's)."""
        with self._lock:
            self.table, self.scores = state[0].copy(), state[1].copy()
            self.pairs = tuple(a.copy() for a in state[2])
            self.k, self.pair_slots = self.table.shape[1], len(self.pairs[0])

    def seed(self, prior: "RecyclePrior") -> None:
        """Fill the rows of `prior`'s tokens (a `recycle_prior.RecyclePrior`) that hold no prediction yet with its
        rows, cut or padded (-1) to the table's k, and its pair rows into empty pair slots; tokens and predictions
        outside the table's vocabulary are left out. Rows already filled keep what verification stored."""
        with self._lock:
            vocab, k = self.table.shape
            inside = prior.tokens < vocab
            tokens, nxt, scores = prior.tokens[inside], prior.next[inside, :k], prior.scores[inside, :k]
            empty = self.table[tokens, 0] < 0
            rows = np.full((int(empty.sum()), k), -1, dtype=np.int32)
            rows[:, :nxt.shape[1]] = np.where(nxt[empty] < vocab, nxt[empty], -1)
            values = np.zeros(rows.shape, dtype=np.float32)
            values[:, :nxt.shape[1]] = scores[empty]
            self.table[tokens[empty]], self.scores[tokens[empty]] = rows, values
            keys = pair_keys(prior.pair_prev, prior.pair_tokens, vocab)
            pair_next = np.where(prior.pair_next < vocab, prior.pair_next, -1).astype(np.int32)
            seed_pairs(*self.pairs, keys, pair_next, prior.pair_scores)

    @property
    def known_tokens(self) -> int:
        """How many token ids have a recycled prediction."""
        with self._lock:
            return int((self.table[:, 0] >= 0).sum())

    @property
    def known_pairs(self) -> int:
        """How many token pairs have a recycled prediction."""
        with self._lock:
            return int((self.pairs[0] >= 0).sum())

    def update(self, tokens: np.ndarray, topk: np.ndarray, values: np.ndarray | None = None,
               prev: np.ndarray | None = None) -> None:
        """Store `topk` ([n, m] int64, best first) as the predicted next tokens of `tokens` ([n] int64), in order
        (a later row wins for a repeated token), with their raw logits `values` ([n, m] float32; None: zeros), and
        as the rows of the pairs (`prev`[i], `tokens`[i]) ([n] int64, the token before each; None or -1: none).
        Rows are cut or padded (-1) to the table's k; tokens and predictions outside the table's vocabulary are
        dropped (-1), so every stored id indexes the table."""
        values = np.zeros(topk.shape, np.float32) if values is None else values
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        with self._lock:
            keys = np.full(len(tokens), -1, np.int64) if prev is None else \
                pair_keys(prev, tokens, self.table.shape[0])
            _update(self.table, self.scores, *self.pairs, tokens, keys, np.ascontiguousarray(topk, dtype=np.int64),
                    np.ascontiguousarray(values, dtype=np.float32))

    def grow(self, grower: "_Grower", root: int, value: np.ndarray, noise: np.ndarray,
             inv_temp: float, prev: int = -1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The draft grown from `root` (after the token `prev`; -1: unknown) by `grower` (see `_grow`): (paths
        [n, max_depth] int64, depth [n] int64, rank [n] int64), nodes in selection order (parents first); empty if
        the root was never verified."""
        if not 0 <= root < self.table.shape[0]:
            return grower.empty()
        with self._lock:
            return grower.grow(self.table, self.scores, self.pairs, prev, root, value, noise, inv_temp)


NO_NOISE = np.zeros(0, dtype=np.uint64)  # `_grow` without noise keys: children ranked by top-k column


class _Grower:
    """Preallocated buffers for growing drafts of up to `max_nodes` nodes, `max_depth` deep, over a k-wide table."""

    def __init__(self, max_nodes: int, max_depth: int, k: int):
        self.max_nodes, self.max_depth, self.k = max_nodes, max_depth, k
        self.paths = np.zeros((max_nodes, max_depth), dtype=np.int64)  # [N, D]
        self.depth = np.zeros(max_nodes, dtype=np.int64)  # [N]
        self.rank = np.zeros(max_nodes, dtype=np.int64)  # [N]
        self.parent = np.zeros(max_nodes, dtype=np.int64)  # [N]
        self.score = np.zeros(max_nodes, dtype=np.float64)  # [N]
        front = (max_nodes + 1) * 2 * k
        self.f_parent = np.zeros(front, dtype=np.int64)
        self.f_token = np.zeros(front, dtype=np.int64)
        self.f_rank = np.zeros(front, dtype=np.int64)
        self.f_score = np.zeros(front, dtype=np.float64)
        self.out_tokens = np.zeros(2 * k, dtype=np.int64)
        self.out_classes = np.zeros(2 * k, dtype=np.int64)
        self.row_tokens = np.zeros(k, dtype=np.int32)
        self.row_scores = np.zeros(k, dtype=np.float32)
        self.places = np.zeros(k, dtype=np.int64)
        self.place_keys = np.zeros(k, dtype=np.float64)

    def empty(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A draft with no nodes."""
        return self.paths[:0], self.depth[:0], self.rank[:0]

    def grow(self, table: np.ndarray, scores: np.ndarray, pairs: tuple, prev: int, root: int, value: np.ndarray,
             noise: np.ndarray, inv_temp: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Run `_grow` on `table` [vocab, k], its `scores` and its pair rows `pairs` (keys, next, scores, seeded) from
        `root` after `prev`; value: [D, 3C] float64 (the classes of token rows, verified pair rows, seeded pair
        rows); noise: [Dn] uint64 keys (`NO_NOISE`: rank by column). Returns copies (paths, depth, rank)."""
        n = _grow(table, scores, *pairs, noise, float(inv_temp), int(prev), root,
                  np.ascontiguousarray(value, dtype=np.float64), self.max_nodes, self.max_depth, self.paths,
                  self.depth, self.rank, self.parent, self.score, self.f_parent, self.f_token, self.f_rank,
                  self.f_score, self.out_tokens, self.out_classes, self.row_tokens, self.row_scores, self.places,
                  self.place_keys)
        return self.paths[:n].copy(), self.depth[:n].copy(), self.rank[:n].copy()


class RecycleDrafter:
    """One sequence's view of a (possibly shared) `RecycleTable`: feeds it from verified rows and grows drafts.

    table: the shared table (None: a private one); vocab_size, k: its shape; max_nodes: nodes per draft;
    max_depth: longest path; prior: a `recycle_prior.RecyclePrior` seeding the table's empty rows (None: none);
    pairs: keep and consult rows per token pair (`recycle_pairs.py`) besides the rows per token (off by default,
    as `LookaheadConfig.recycle_pairs`).
    """

    def __init__(self, table: RecycleTable | None, vocab_size: int, k: int, max_nodes: int, max_depth: int,
                 prior: "RecyclePrior | None" = None, pairs: bool = False):
        self.table = table if table is not None else RecycleTable(k, PAIR_SLOTS if pairs else 0)
        self.table.ensure(vocab_size, k)
        if prior is not None:
            self.table.seed(prior)
        self.k, self.pairs = k, pairs
        self._grower = _Grower(max_nodes, max_depth, k)

    def observe(self, tokens: np.ndarray, logits, order: np.ndarray | None = None,
                prev: np.ndarray | None = None, tops: RowTops | None = None) -> None:
        """Recycle the rows' predictions: `tokens` [n] int64 the token each row carries, `logits` [n, V] (torch)
        their logits, `prev` [n] int64 the token before each row's token (None or -1: unknown); `order` [m] the
        rows to store, in order (None = all; put the accepted path last); `tops`: the logits' `top_k` at this
        table's k when the caller has it (`tops_k`), else computed here."""
        topk, values, _ = tops if tops is not None else top_k(logits, self.tops_k(logits))  # [n, k] each
        prev = prev if self.pairs else None
        if order is not None:
            tokens, topk, values = tokens[order], topk[order], values[order]
            prev = None if prev is None else np.asarray(prev)[order]
        self.table.update(np.asarray(tokens, dtype=np.int64), topk, values, prev)

    def tops_k(self, logits) -> int:
        """The k of the top-k `observe` reads from logits [n, V]."""
        return min(self.k, logits.shape[-1])

    def propose(self, root: int, value: np.ndarray, max_len: int, noise: np.ndarray = NO_NOISE,
                inv_temp: float = 1.0, prev: int = -1, pair_value: np.ndarray | None = None,
                seeded_value: np.ndarray | None = None) -> tuple[list[np.ndarray], np.ndarray]:
        """Draft paths from `root` (after the token `prev`; -1: unknown): one path per grown node (root's child
        down to the node, parents first) and each node's class [n] int64 (see the module docstring; C + its class
        for a node from a verified pair's row, 2C + its class from a seeded one). `value` [D, C]: conditional
        acceptance by depth and class of a node from a token's row, `pair_value` and `seeded_value` [D, C] of one
        from a verified or seeded pair's row (None: `value`); paths are cut to `max_len` tokens (deeper nodes are
        dropped). `noise` [Dn] uint64: the seeded rule's noise keys of the indices of depths 1..Dn
        (`draft_noise.DraftNoise`), which then places a node's children by recycled logit * `inv_temp` + noise (the
        order the seeded draw would pick them in) instead of by top-k column."""
        value = np.hstack([value] + [value if v is None else v for v in (pair_value, seeded_value)])
        grown = self.table.grow(self._grower, int(root), value, noise, inv_temp, int(prev) if self.pairs else -1)
        paths, depth, rank = grown
        keep = depth <= max_len
        return [p[:d] for p, d in zip(paths[keep], depth[keep].tolist())], rank[keep]
