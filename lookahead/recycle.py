"""Token recycling: the target's own top-k next tokens, kept per token from every verification forward and grown
into a draft tree from the root (Luo et al., "Turning Trash into Treasure", ACL 2025).

Every step's forward already computes the logits of every verified row, including the rejected ones. For the
token t a row carries, the row's top-k tokens are what the target expects after t (in that row's context); the
adjacency table keeps them, one row per token id:

    table [vocab, k] int32: table[t, r] = the r-th most likely next token the last time a row carrying t was
                            verified (-1 = t never verified)

A step overwrites the table rows of every token it verified, the accepted path last, so for a token verified
twice in one step the prediction with the true context wins. A draft is grown from the root best-first over
the table: a node's children are its token's table row, and a child of top-k rank r at depth d is worth its
parent's value times the estimated probability `value[d - 1, r]` that such a node is accepted once its parent
is (the planner's learned estimate for recycled nodes). The `max_nodes` most valuable nodes form the draft, so
its shape (wide near the root, deep along confident chains) follows what is accepted, not a fixed template.

Memory: `vocab × k` int32 (49152 × 8 → 1.5 MB). One table can serve many generations (a `Lookahead` object's
calls, a server's requests); all methods are thread-safe.
"""

from __future__ import annotations

import threading

import numba
import numpy as np


@numba.njit(cache=True)
def _update(table, tokens, topk):
    """table[tokens[i]] = topk[i] for i in order (a later row wins for a repeated token).

    table: [vocab, k] int32; tokens: [n] int64 in [0, vocab); topk: [n, k] int64."""
    k = table.shape[1]
    for i in range(tokens.shape[0]):
        t = tokens[i]
        for r in range(k):
            table[t, r] = topk[i, r]


@numba.njit(cache=True)
def _grow(table, root, value, max_nodes, max_depth, paths, depth, rank, parent, score, f_parent, f_rank, f_score):
    """Best-first growth of a draft tree from `root` over `table`; returns the node count n <= max_nodes.

    value: [D, k] float64, conditional acceptance of a node at depth d (row d - 1, last row for deeper ones) and
    top-k rank r; max_depth <= paths.shape[1]. Writes, per node in selection order (a parent before its
    children): paths[i, :depth[i]] its tokens from the root's child down to it, depth[i], rank[i] (its top-k
    rank under its parent), parent[i] (-1 = the root), score[i] (product of the values along its path).
    f_parent / f_rank / f_score: frontier scratch of at least max_nodes * k + k entries.
    """
    k = table.shape[1]
    n_front = 0
    for r in range(k):  # the root's children
        if table[root, r] >= 0:
            f_parent[n_front], f_rank[n_front], f_score[n_front] = -1, r, value[0, r]
            n_front += 1
    n = 0
    while n < max_nodes and n_front > 0:
        best = 0
        for j in range(1, n_front):
            if f_score[j] > f_score[best]:
                best = j
        p, r, s = f_parent[best], f_rank[best], f_score[best]
        n_front -= 1  # remove `best`, keeping insertion order: ties go to the earlier (shallower, better-ranked)
        for j in range(best, n_front):
            f_parent[j], f_rank[j], f_score[j] = f_parent[j + 1], f_rank[j + 1], f_score[j + 1]
        d = 1 if p < 0 else depth[p] + 1
        for j in range(d - 1):
            paths[n, j] = paths[p, j]
        token = table[root, r] if p < 0 else table[paths[p, d - 2], r]
        paths[n, d - 1] = token
        depth[n], rank[n], parent[n], score[n] = d, r, p, s
        if d < max_depth:
            row = min(d, value.shape[0] - 1)
            for r2 in range(k):
                if table[token, r2] >= 0:
                    f_parent[n_front], f_rank[n_front], f_score[n_front] = n, r2, s * value[row, r2]
                    n_front += 1
        n += 1
    return n


class RecycleTable:
    """The adjacency table of recycled top-k predictions (see the module docstring), shareable and thread-safe.

    The table is allocated for a vocabulary on first use (`ensure`); a call with another vocabulary size or k
    starts a fresh table. Raises `ValueError` naming `k` unless 1 <= k <= 64.
    """

    def __init__(self, k: int = 8):
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
            raise ValueError(f"k must be an int in [1, 64], got {k!r}")
        self.k = k
        self._lock = threading.Lock()
        self.table = np.full((0, k), -1, dtype=np.int32)  # [vocab, k]
        # Compile (or load from numba's disk cache) both kernels once, on a one-token table.
        warm = np.full((1, 1), -1, dtype=np.int32)
        _update(warm, np.zeros(1, np.int64), np.zeros((1, 1), np.int64))
        _Grower(1, 1, 1).grow(warm, 0, np.ones((1, 1)))

    def ensure(self, vocab_size: int, k: int) -> None:
        """Make the table `[vocab_size, k]`, forgetting what it held if its shape changes."""
        with self._lock:
            if self.table.shape != (vocab_size, k):
                self.k = k
                self.table = np.full((vocab_size, k), -1, dtype=np.int32)

    def clear(self) -> None:
        """Forget every recycled prediction (the shape stays)."""
        with self._lock:
            self.table.fill(-1)

    def snapshot(self) -> np.ndarray:
        """A copy of the table ([vocab, k] int32), for `restore`."""
        with self._lock:
            return self.table.copy()

    def restore(self, state: np.ndarray) -> None:
        """Put back a `snapshot` (its shape becomes the table's)."""
        with self._lock:
            self.table = state.copy()
            self.k = state.shape[1]

    @property
    def known_tokens(self) -> int:
        """How many token ids have a recycled prediction."""
        with self._lock:
            return int((self.table[:, 0] >= 0).sum())

    def update(self, tokens: np.ndarray, topk: np.ndarray) -> None:
        """Store `topk` ([n, m] int64, best first) as the predicted next tokens of `tokens` ([n] int64), in order
        (a later row wins for a repeated token). Rows are cut or padded (-1) to the table's k; tokens and
        predictions outside the table's vocabulary are dropped (-1), so every stored id indexes the table."""
        with self._lock:
            vocab, k = self.table.shape
            keep = (tokens >= 0) & (tokens < vocab)
            rows = np.full((int(keep.sum()), k), -1, dtype=np.int64)  # [n', k]
            width = min(k, topk.shape[1])
            rows[:, :width] = topk[keep, :width]
            rows[rows >= vocab] = -1
            _update(self.table, np.ascontiguousarray(tokens[keep], dtype=np.int64), rows)

    def grow(self, grower: "_Grower", root: int, value: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The draft grown from `root` by `grower` (see `_grow`): (paths [n, max_depth] int64, depth [n] int64,
        rank [n] int64), nodes in selection order (parents first); empty if the root was never verified."""
        if not 0 <= root < self.table.shape[0]:
            return grower.empty()
        with self._lock:
            return grower.grow(self.table, root, value)


class _Grower:
    """Preallocated buffers for growing drafts of up to `max_nodes` nodes, `max_depth` deep, over a k-wide table."""

    def __init__(self, max_nodes: int, max_depth: int, k: int):
        self.max_nodes, self.max_depth, self.k = max_nodes, max_depth, k
        self.paths = np.zeros((max_nodes, max_depth), dtype=np.int64)  # [N, D]
        self.depth = np.zeros(max_nodes, dtype=np.int64)  # [N]
        self.rank = np.zeros(max_nodes, dtype=np.int64)  # [N]
        self.parent = np.zeros(max_nodes, dtype=np.int64)  # [N]
        self.score = np.zeros(max_nodes, dtype=np.float64)  # [N]
        front = max_nodes * k + k
        self.f_parent = np.zeros(front, dtype=np.int64)
        self.f_rank = np.zeros(front, dtype=np.int64)
        self.f_score = np.zeros(front, dtype=np.float64)

    def empty(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A draft with no nodes."""
        return self.paths[:0], self.depth[:0], self.rank[:0]

    def grow(self, table: np.ndarray, root: int, value: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Run `_grow` on `table` [vocab, k]; value: [D, k] float64. Returns copies (paths, depth, rank)."""
        n = _grow(table, root, np.ascontiguousarray(value, dtype=np.float64), self.max_nodes, self.max_depth,
                  self.paths, self.depth, self.rank, self.parent, self.score, self.f_parent, self.f_rank,
                  self.f_score)
        return self.paths[:n].copy(), self.depth[:n].copy(), self.rank[:n].copy()


class RecycleDrafter:
    """One sequence's view of a (possibly shared) `RecycleTable`: feeds it from verified rows and grows drafts.

    table: the shared table (None: a private one); vocab_size, k: its shape; max_nodes: nodes per draft;
    max_depth: longest path.
    """

    def __init__(self, table: RecycleTable | None, vocab_size: int, k: int, max_nodes: int, max_depth: int):
        self.table = table if table is not None else RecycleTable(k)
        self.table.ensure(vocab_size, k)
        self.k = k
        self._grower = _Grower(max_nodes, max_depth, k)

    def observe(self, tokens: np.ndarray, logits, order: np.ndarray | None = None) -> None:
        """Recycle the rows' predictions: `tokens` [n] int64 the token each row carries, `logits` [n, V] (torch)
        their logits; `order` [m] the rows to store, in order (None = all; put the accepted path last)."""
        import torch

        k = min(self.k, logits.shape[-1])
        topk = torch.topk(logits, k, dim=-1).indices.cpu().numpy()  # [n, k], one vectorised call per step
        if order is not None:
            tokens, topk = tokens[order], topk[order]
        self.table.update(np.asarray(tokens, dtype=np.int64), topk)

    def propose(self, root: int, value: np.ndarray, max_len: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Draft paths from `root`: one path per grown node (root's child down to the node, parents first) and
        each node's top-k rank [n] int64. `value` [D, k]: conditional acceptance by depth and rank; paths are
        cut to `max_len` tokens (deeper nodes are dropped)."""
        paths, depth, rank = self.table.grow(self._grower, int(root), value)
        keep = depth <= max_len
        return [p[:d] for p, d in zip(paths[keep], depth[keep].tolist())], rank[keep]
