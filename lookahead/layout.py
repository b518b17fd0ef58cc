"""Pack `[tree (root first) | window]` of every sequence of the batch into the inputs of ONE target forward.

Per sequence, rows 0..N-1 are the tree nodes (row 0 = root), rows N..N+M-1 the window cells. Every row sees the
visible part of its sequence's cached prefix; a tree node sees its ancestors and itself; a window cell sees the
root and the window cells the Jacobi rule allows (see `jacobi.py`); tree and window never see each other. In a
model's sliding-window layers a row further sees only the `window` latest positions of its own text (itself
included), so those layers get a mask of their own.
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


@dataclass(frozen=True)
class SlidingWindow:
    """How a model's sliding-window layers attend. A row at position p sees the tokens of its own text at positions
    p - size + 1 .. p (transformers' `sliding_window_overlay`: key index > query index - size; a sequence's text
    sits in consecutive positions, so counting positions counts its tokens). layer_types: the model's distinct
    layer types (`config.layer_types`); with more than "sliding_attention" the forward takes a mask per type."""

    size: int
    layer_types: tuple[str, ...]


def sliding_window(config) -> SlidingWindow | None:
    """The sliding window of a transformers model config (of its text decoder), or None when no layer slides.

    Raises `ValueError` if its sliding layers have different window sizes.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    sizes = {layer["sliding_window"] for kind, layer in zip(types, kwargs) if kind == "sliding_attention"}
    if not sizes:
        return None
    if len(sizes) > 1:
        raise ValueError(f"lookahead supports one sliding-window size per model, this one has {sorted(sizes)}; "
                         "use plain model.generate")
    return SlidingWindow(sizes.pop(), tuple(sorted(set(types))))


@dataclass(frozen=True)
class StepInputs:
    """Model inputs for one verification forward of B sequences, each padded to T rows.

    input_ids:      [B, T] int64
    position_ids:   [B, T] int64 (tree nodes: root position + depth; window: root position + offset)
    attention_mask: [B, 1, T, prefix_len + T] additive float (0 = attend, dtype min = blocked), or None; for a
                    model whose sliding-window layers see less than its other layers this step, a dict
                    {layer type: mask} as transformers' decoders accept (`SlidingWindow.layer_types`)
    n_tree:         per sequence N_b: its first N_b rows are its tree (then its window, then padding)
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None
    n_tree: tuple[int, ...]


def pack(tree: DraftTree, window: JacobiWindow | None, root_position: int, prefix_len: int,
         prefix_hidden: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> StepInputs:
    """Build the inputs of one step of one sequence (see `pack_batch`).

    root_position: the root's position id; prefix_len: cached slots; prefix_hidden: [prefix_len] bool, cached
    slots no row may attend to (padding), or None when all are visible. Its attention_mask is None for a single
    row (the root alone) with nothing hidden (the model's fastest path).
    """
    return pack_batch([SequenceDrafts(tree, window, root_position, prefix_hidden)], prefix_len, dtype, device)


def pack_batch(drafts: list[SequenceDrafts], prefix_len: int, dtype: torch.dtype, device: torch.device,
               window: SlidingWindow | None = None) -> StepInputs:
    """Build the inputs of one step of a batch that shares `prefix_len` cached slots.

    Sequence b gets T_b rows; all are padded to T = max T_b with filler rows that see only themselves (their
    outputs and cache slots are discarded). The mask is None only for one row per sequence with nothing hidden
    (then the model's own causal, and sliding-window, masks are exact: every slot holds the next token of the
    text). `window`: the model's sliding window (None = no sliding layers).
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
        attention_mask=None if nothing_masked else _attention_mask(parts, drafts, positions, prefix_len, dtype,
                                                                   device, window),
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


def _attention_mask(parts, drafts: list[SequenceDrafts], positions: np.ndarray, prefix_len: int,
                    dtype: torch.dtype, device: torch.device,
                    window: SlidingWindow | None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The step's mask (see `StepInputs.attention_mask`; positions: [B, T] the rows' position ids): one for every
    layer while no row's window cuts anything it may see, else the sliding layers' own."""
    allowed = _visibility(parts, drafts, prefix_len, positions.shape[1])  # [B, T, prefix_len + T]
    if window is None:
        return _additive(allowed, dtype, device)
    sliding = allowed & _within_window(drafts, positions, prefix_len, window.size)
    if np.array_equal(sliding, allowed):
        return _additive(allowed, dtype, device)
    if window.layer_types == ("sliding_attention",):
        return _additive(sliding, dtype, device)
    full = _additive(allowed, dtype, device)
    return {kind: _additive(sliding, dtype, device) if kind == "sliding_attention" else full
            for kind in window.layer_types}


def _visibility(parts, drafts: list[SequenceDrafts], prefix_len: int, t: int) -> np.ndarray:
    """[B, T, prefix_len + T] bool: each sequence's visible prefix and block; filler rows see only themselves."""
    allowed = np.zeros((len(drafts), t, prefix_len + t), dtype=bool)
    for b, ((seq_ids, _, block), d) in enumerate(zip(parts, drafts)):
        n = len(seq_ids)
        allowed[b, :n, :prefix_len] = True if d.hidden is None else ~d.hidden.numpy()
        allowed[b, :n, prefix_len: prefix_len + n] = block
        filler = np.arange(n, t)
        allowed[b, filler, prefix_len + filler] = True
    return allowed


def _within_window(drafts: list[SequenceDrafts], positions: np.ndarray, prefix_len: int, size: int) -> np.ndarray:
    """[B, T, prefix_len + T] bool: the column's position is among the `size` latest up to the row's (positions:
    [B, T] the rows'); whether the row may see the column at all is `_visibility`'s business."""
    prefix = np.stack([_prefix_positions(d, prefix_len) for d in drafts])  # [B, prefix_len]
    columns = np.concatenate([prefix, positions], axis=1)
    return positions[:, :, None] - columns[:, None, :] < size


def _prefix_positions(drafts: SequenceDrafts, prefix_len: int) -> np.ndarray:
    """[prefix_len] position ids of a sequence's cached slots. Its visible slots hold its text before the root in
    order, so they sit at consecutive positions ending just before the root's; hidden slots (padding, holes) get
    the position of the next visible one, and are masked anyway."""
    visible = np.ones(prefix_len, dtype=bool) if drafts.hidden is None else ~drafts.hidden.numpy()
    from_here = np.cumsum(visible[::-1])[::-1]  # visible slots at or after each slot
    return drafts.root_position - from_here


def _additive(allowed: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[B, T, S] bool -> [B, 1, T, S] additive mask (0 = attend, dtype min = blocked)."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(torch.from_numpy(~allowed), torch.finfo(dtype).min)
    return mask.to(device).unsqueeze(1)
