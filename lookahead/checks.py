"""Validation at the boundary of the numba-backed drafters: integers in range and token-id arrays.

Each raises `ValueError` naming the field and what is allowed. Internal callers that already hold validated
arrays do not call these again.
"""

from __future__ import annotations

import numpy as np


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """Return `value` as an int; raise ValueError naming `name` unless it is an int in [low, high] (no upper
    bound when `high` is None)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return int(value)


def as_token_ids(name: str, value: object, ndim: int = 1, vocab_size: int | None = None) -> np.ndarray:
    """`value` as a C-contiguous int64 array of token ids; raise ValueError naming `name` unless it is an
    integer array of `ndim` dimensions with every entry >= 0 (and < `vocab_size` when given)."""
    raw = np.asarray(value)
    if raw.size > 0 and raw.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer token ids, got dtype {raw.dtype}")
    if raw.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {raw.shape}")
    arr = np.ascontiguousarray(raw, dtype=np.int64)  # ids beyond int64 wrap negative and are rejected below
    if arr.size and (arr.min() < 0 or (vocab_size is not None and arr.max() >= vocab_size)):
        bound = "2**63" if vocab_size is None else f"vocab_size={vocab_size}"
        raise ValueError(f"{name} must be token ids in [0, {bound}), got [{raw.min()}, {raw.max()}]")
    return arr
