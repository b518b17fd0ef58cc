"""Pack `[tree (root first) | window]` into the inputs of ONE target forward.

Rows 0..N-1 are the tree nodes (row 0 = root), rows N..N+M-1 the window cells. Every row sees the visible
part of the cached prefix; a tree node sees its ancestors and itself; a window cell sees the root and the
window cells the Jacobi rule allows (see `jacobi.py`); tree and window never see each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .jacobi import JacobiWindow
from .tree import DraftTree


@dataclass(frozen=True)
class StepInputs:
    """Model inputs for one verification forward, batch size 1.

    input_ids:      [1, T] int64
    position_ids:   [1, T] int64 (tree nodes: root position + depth; window: root position + offset)
    attention_mask: [1, 1, T, prefix_len + T] additive float (0 = attend, dtype min = blocked)
    n_tree:         N, the first N rows are the tree
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    n_tree: int


def pack(tree: DraftTree, window: JacobiWindow | None, root_position: int, prefix_len: int,
         prefix_hidden: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> StepInputs:
    """Build the inputs of one step.

    root_position: the root's position id; prefix_len: cached slots; prefix_hidden: [prefix_len] bool, cached
    slots no row may attend to (padding), or None when all are visible. Returns a `StepInputs`; its
    attention_mask is None for a single row with nothing hidden (the model's fastest path).
    """
    tree_mask = tree.ancestor_mask()  # [N, N]
    ids, offsets = tree.tokens, tree.depth
    if window is not None:
        n, m = tree.size, window.size
        block = np.zeros((n + m, n + m), dtype=bool)
        block[:n, :n] = tree_mask
        block[n:, 0] = True  # window cells see the root
        block[n:, n:] = window.mask
        tree_mask = block
        ids = np.concatenate([ids, window.flat_tokens()])
        offsets = np.concatenate([offsets, window.offsets])
    t = ids.shape[0]
    return StepInputs(
        input_ids=torch.from_numpy(ids).to(device).view(1, t),
        position_ids=(torch.from_numpy(offsets) + root_position).to(device).view(1, t),
        attention_mask=_additive_mask(tree_mask, prefix_len, prefix_hidden, dtype, device),
        n_tree=tree.size,
    )


def _additive_mask(block: np.ndarray, prefix_len: int, prefix_hidden: torch.Tensor | None,
                   dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """[1, 1, T, prefix_len + T] additive mask from the [T, T] bool block (None if nothing is masked)."""
    t = block.shape[0]
    if t == 1 and prefix_hidden is None:
        return None
    blocked = torch.finfo(dtype).min
    mask = torch.zeros((t, prefix_len + t), dtype=dtype)
    mask[:, prefix_len:].masked_fill_(torch.from_numpy(~block), blocked)
    if prefix_hidden is not None:
        mask[:, :prefix_len].masked_fill_(prefix_hidden, blocked)
    return mask.to(device).view(1, 1, t, prefix_len + t)
