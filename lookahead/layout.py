"""Pack `[tree (root first) | window]` of every sequence of the batch into the inputs of ONE target forward.

Per sequence, rows 0..N-1 are the tree nodes (row 0 = root), rows N..N+M-1 the window cells. Every row sees the
visible part of its sequence's cached prefix; a tree node sees its ancestors and itself; a window cell sees the
root and the window cells the Jacobi rule allows (see `jacobi.py`); tree and window never see each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .jacobi import JacobiWindow
from .tree import DraftTree


@dataclass(frozen=True)
class SequenceDrafts:
    """What one sequence of the batch verifies this step: its tree, its window (or None), the root's position id
    and the cached slots it must not see (`hidden`: [prefix_len] bool, or None when all are visible)."""

    tree: DraftTree
    window: JacobiWindow | None
    root_position: int
    hidden: torch.Tensor | None = None


# The former name ("row" now means a token row of the forward only); `sequence.py` still imports it.
RowDrafts = SequenceDrafts


@dataclass(frozen=True)
class StepInputs:
    """Model inputs for one verification forward of B sequences, each padded to T rows.

    input_ids:      [B, T] int64
    position_ids:   [B, T] int64 (tree nodes: root position + depth; window: root position + offset)
    attention_mask: [B, 1, T, prefix_len + T] additive float (0 = attend, dtype min = blocked), or None
    n_tree:         per sequence N_b: its first N_b rows are its tree (then its window, then padding)
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    n_tree: tuple[int, ...]


def pack(tree: DraftTree, window: JacobiWindow | None, root_position: int, prefix_len: int,
         prefix_hidden: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> StepInputs:
    """Build the inputs of one step of one sequence (see `pack_batch`).

    root_position: the root's position id; prefix_len: cached slots; prefix_hidden: [prefix_len] bool, cached
    slots no row may attend to (padding), or None when all are visible. Its attention_mask is None for a single
    row (the root alone) with nothing hidden (the model's fastest path).
    """
    return pack_batch([SequenceDrafts(tree, window, root_position, prefix_hidden)], prefix_len, dtype, device)


def pack_batch(drafts: list[SequenceDrafts], prefix_len: int, dtype: torch.dtype,
               device: torch.device) -> StepInputs:
    """Build the inputs of one step of a batch that shares `prefix_len` cached slots.

    Sequence b gets T_b rows; all are padded to T = max T_b with filler rows that see only themselves (their
    outputs and cache slots are discarded). The mask is None only for one row per sequence with nothing hidden.
    """
    parts = [_sequence_parts(d) for d in drafts]
    t = max(len(ids) for ids, _, _ in parts)
    ids = np.zeros((len(drafts), t), dtype=np.int64)
    positions = np.zeros((len(drafts), t), dtype=np.int64)
    for b, (seq_ids, seq_positions, _) in enumerate(parts):
        ids[b, : len(seq_ids)], ids[b, len(seq_ids):] = seq_ids, seq_ids[0]
        positions[b, : len(seq_ids)], positions[b, len(seq_ids):] = seq_positions, seq_positions[0]
    nothing_masked = t == 1 and all(d.hidden is None for d in drafts)
    return StepInputs(
        input_ids=torch.from_numpy(ids).to(device),
        position_ids=torch.from_numpy(positions).to(device),
        attention_mask=None if nothing_masked else _additive_mask(parts, drafts, prefix_len, t, dtype, device),
        n_tree=tuple(d.tree.size for d in drafts),
    )


def _sequence_parts(drafts: SequenceDrafts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [T_b], position ids [T_b], visibility block [T_b, T_b] bool) of one sequence's tree + window."""
    tree, window = drafts.tree, drafts.window
    block = tree.ancestor_mask()  # [N, N]
    ids, offsets = tree.tokens, tree.depth
    if window is not None:
        n, m = tree.size, window.size
        full = np.zeros((n + m, n + m), dtype=bool)
        full[:n, :n] = block
        full[n:, 0] = True  # window cells see the root
        full[n:, n:] = window.mask
        block = full
        ids = np.concatenate([ids, window.flat_tokens()])
        offsets = np.concatenate([offsets, window.offsets])
    return ids, offsets + drafts.root_position, block


def _additive_mask(parts, drafts: list[SequenceDrafts], prefix_len: int, t: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """[B, 1, T, prefix_len + T] additive mask: each sequence's visible prefix and block; filler rows see only
    themselves."""
    allowed = np.zeros((len(drafts), t, prefix_len + t), dtype=bool)
    for b, ((seq_ids, _, block), d) in enumerate(zip(parts, drafts)):
        n = len(seq_ids)
        allowed[b, :n, :prefix_len] = True if d.hidden is None else ~d.hidden.numpy()
        allowed[b, :n, prefix_len: prefix_len + n] = block
        filler = np.arange(n, t)
        allowed[b, filler, prefix_len + filler] = True
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(torch.from_numpy(~allowed), torch.finfo(dtype).min)
    return mask.to(device).unsqueeze(1)
