"""The Jacobi lookahead window: `levels × columns` guessed tokens iterated in parallel every step.

Cell (l, j) sits at position `root + 1 + j + l` and attends to the prefix, the root, the level-0 cells
(0, 0..j) and the cells (1..l, j) of its own column: that is the token sequence a Jacobi iteration would
condition it on. Its argmax is a guess for position `root + 2 + j + l`. Each step every level moves up one
level and the last level's outputs become the new last level; the column (0..L-1, j) plus the output of
(L-1, j) is an n-gram of `L + 1` consecutive-position guesses, harvested into the n-gram pool.
"""

from __future__ import annotations

import numpy as np


class JacobiWindow:
    """Owns the window tokens `[levels, columns]` and its fixed in-window attention structure."""

    def __init__(self, levels: int, columns: int, seed: int = 0):
        if levels < 1 or columns < 1:
            raise ValueError(f"window needs levels >= 1 and columns >= 1, got {levels} x {columns}")
        self.levels, self.columns = levels, columns
        self.tokens = np.zeros((levels, columns), dtype=np.int64)  # [L, W]
        self._rng = np.random.default_rng(seed)
        self._age = 0  # advances since the last reset: harvesting starts at age >= levels - 1 (as in LADE)
        self.offsets = self._offsets()  # [L*W] position offsets from the root
        self.mask = self._mask()  # [L*W, L*W] bool, in-window visibility

    @property
    def size(self) -> int:
        """Number of window rows (`levels × columns`)."""
        return self.levels * self.columns

    def reset(self, context: np.ndarray) -> None:
        """Fill every cell with random tokens drawn from `context` ([n] int64, the committed text)."""
        self.tokens[:] = self._rng.choice(context, size=self.tokens.shape)
        self._age = 0

    def flat_tokens(self) -> np.ndarray:
        """[L*W] int64, window tokens in row order (level-major)."""
        return self.tokens.reshape(-1)

    def advance(self, outputs: np.ndarray, n_committed: int, context: np.ndarray) -> np.ndarray:
        """Advance one Jacobi iteration and return the harvested n-grams.

        outputs: [L*W] argmax of each window row; n_committed: tokens committed this step (>= 1), so the root
        moved by that much and columns shift left by `n_committed - 1`; context: committed text used to fill
        vacated columns. Returns [G, L+1] int64 n-grams (G = 0 while the levels still hold random fill).
        """
        outputs = outputs.reshape(self.levels, self.columns)
        grams = self._harvest(outputs) if self._age >= self.levels - 1 else np.zeros((0, self.levels + 1), np.int64)
        stacked = np.concatenate([self.tokens[1:], outputs[-1:]], axis=0)  # [L, W]: every level moves up one
        shift = min(n_committed - 1, self.columns)
        if shift:
            stacked = np.concatenate([stacked[:, shift:], self._rng.choice(context, size=(self.levels, shift))], 1)
        self.tokens = np.ascontiguousarray(stacked)
        self._age += 1
        return grams

    def _harvest(self, outputs: np.ndarray) -> np.ndarray:
        """[W, L+1] n-grams: each column's levels followed by its last level's output."""
        return np.concatenate([self.tokens.T, outputs[-1][:, None]], axis=1)

    def _offsets(self) -> np.ndarray:
        """Position offset from the root of each cell: `1 + j + l`."""
        level, column = np.divmod(np.arange(self.size), self.columns)
        return (1 + column + level).astype(np.int64)

    def _mask(self) -> np.ndarray:
        """[L*W, L*W] bool: cell (l, j) sees (0, 0..j) and (1..l, j), itself included."""
        level, column = np.divmod(np.arange(self.size), self.columns)
        first_level = (level[None, :] == 0) & (column[None, :] <= column[:, None])
        same_column = (column[None, :] == column[:, None]) & (level[None, :] <= level[:, None])
        return first_level | same_column
