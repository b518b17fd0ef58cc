"""`DraftTree`: all candidate paths merged into a trie rooted at the root token, pruned to a node budget."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Score decay per depth: shallow nodes are likelier to be accepted, so under a tight budget the tree keeps
# breadth near the root before depth on one branch.
DEPTH_DECAY = 0.8


@dataclass(frozen=True)
class DraftTree:
    """A trie of draft tokens. Node 0 is the root; parents precede children (`parents[i] < i`).

    tokens:  [N] int64, token of each node (tokens[0] = root token)
    parents: [N] int64, parent node (-1 for the root)
    depth:   [N] int64, edges from the root
    source:  [N] int64, index of the drafter that first proposed the node (-1 for the root)
    scores:  [N] float64, pruning priority (root = inf); a child never outscores its parent
    children: per node, {token: child node}; siblings carry distinct tokens by construction
    """

    tokens: np.ndarray
    parents: np.ndarray
    depth: np.ndarray
    source: np.ndarray
    scores: np.ndarray
    children: tuple

    @property
    def size(self) -> int:
        """Number of nodes including the root."""
        return int(self.tokens.shape[0])

    @classmethod
    def from_paths(cls, root: int, paths: list, sources: list[int], budget: int) -> "DraftTree":
        """Merge candidate `paths` (token sequences continuing `root`, best first) into a trie.

        Each node scores the sum over the paths through it of `1/(rank+1) * DEPTH_DECAY**depth`; the
        `budget` best nodes (ties: earlier first) are kept besides the root. A parent always scores at least
        as high as its child and is created before it, so the kept set is prefix-closed.
        Raises `ValueError` if `paths` and `sources` differ in length or `budget` < 0.
        """
        if len(paths) != len(sources):
            raise ValueError(f"got {len(paths)} paths but {len(sources)} sources")
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        tokens, parents, source, scores = [int(root)], [-1], [-1], [np.inf]
        index: dict[tuple[int, int], int] = {}
        for rank, path in enumerate(paths):
            weight, node, origin = 1.0 / (rank + 1), 0, int(sources[rank])
            for depth, token in enumerate(path.tolist() if isinstance(path, np.ndarray) else path, start=1):
                key = (node, int(token))
                child = index.get(key)
                if child is None:
                    child = index[key] = len(tokens)
                    tokens.append(key[1]), parents.append(node), source.append(origin)
                    scores.append(0.0)
                scores[child] += weight * DEPTH_DECAY**depth
                node = child
        scores = np.asarray(scores)
        keep = _best_nodes(scores, budget)
        return cls._build(np.asarray(tokens, dtype=np.int64)[keep], np.asarray(parents, dtype=np.int64)[keep],
                          np.asarray(source, dtype=np.int64)[keep], scores[keep], keep)

    def prune(self, budget: int) -> "DraftTree":
        """This tree cut to the root plus its `budget` best-scoring nodes (the same rule as `from_paths`)."""
        keep = _best_nodes(self.scores, budget)
        if len(keep) == self.size:
            return self
        return self._build(self.tokens[keep], self.parents[keep], self.source[keep], self.scores[keep], keep)

    def ranked_nodes(self) -> np.ndarray:
        """Non-root node indices, best score first: `prune(k)` keeps exactly the first k of them."""
        return np.argsort(-self.scores[1:], kind="stable") + 1

    @classmethod
    def _build(cls, tokens, parents, source, scores, keep) -> "DraftTree":
        """Renumber kept nodes (in creation order) and derive depth and child tables."""
        if len(keep) == 0 or int(keep[-1]) == len(keep) - 1:  # every node up to the last kept: numbers unchanged
            parents = parents.astype(np.int64)
        else:
            renumber = {old: new for new, old in enumerate(keep.tolist())}
            parents = np.array([-1] + [renumber[p] for p in parents[1:].tolist()], dtype=np.int64)
        children = tuple({} for _ in range(len(keep)))
        listed_parents, listed_tokens, depth = parents.tolist(), tokens.tolist(), [0] * len(keep)
        for node in range(1, len(keep)):
            parent = listed_parents[node]
            depth[node] = depth[parent] + 1
            children[parent][listed_tokens[node]] = node
        return cls(tokens.astype(np.int64), parents, np.array(depth, dtype=np.int64), source.astype(np.int64),
                   scores.astype(np.float64), children)

    def ancestor_mask(self) -> np.ndarray:
        """[N, N] bool: `mask[i, j]` is True iff node j is node i or one of its ancestors."""
        n = self.size
        mask = np.zeros((n, n), dtype=bool)
        for node in range(n):
            parent = self.parents[node]
            if parent >= 0:
                mask[node] = mask[parent]
            mask[node, node] = True
        return mask

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root's first child down to `node` (empty for the root)."""
        out = []
        while node > 0:
            out.append(int(self.tokens[node]))
            node = int(self.parents[node])
        return out[::-1]


def _best_nodes(scores: np.ndarray, budget: int) -> np.ndarray:
    """Indices of the root plus the `budget` highest-scoring nodes, in creation order."""
    if scores.shape[0] - 1 <= budget:
        return np.arange(scores.shape[0])
    # Stable sort on -score keeps creation order among ties, so a parent beats an equal-scored child.
    order = np.argsort(-scores, kind="stable")[: budget + 1]
    return np.sort(order)
