"""The target's final normed hidden states, as its LM head receives them, for drafters that read them
(`draft_head.py`).

Every forward already computes them: they are the LM head's input. `hidden_tap(model)` records that input with a
forward pre-hook on the model's output embeddings (no copy, nothing recomputed; the head's own forward, fused or
bounded, runs as before) and removes the hook on exit, also on error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class HiddenTap:
    """The LM head inputs of the forwards since the last `take()`, in call order (each `[B, T, size]`)."""

    def __init__(self):
        self._seen: list[torch.Tensor] = []

    def __call__(self, module, args) -> None:
        """The forward pre-hook: remember the head's input."""
        if args and isinstance(args[0], torch.Tensor):
            self._seen.append(args[0])

    def take(self) -> list[torch.Tensor]:
        """The inputs recorded since the last call, oldest first; forgets them."""
        seen, self._seen = self._seen, []
        return seen

    def last(self) -> torch.Tensor | None:
        """The latest forward's head input `[B, T, size]` (None if there was none since the last `take()`);
        forgets every recorded input."""
        seen = self.take()
        return seen[-1] if seen else None


@contextlib.contextmanager
def hidden_tap(model, enabled: bool = True) -> Iterator[HiddenTap | None]:
    """Within the block the yielded `HiddenTap` records the input of `model`'s LM head on every forward; yields None
    (and records nothing) when not `enabled` or the model has no output embeddings module."""
    head = model.get_output_embeddings() if enabled else None
    if head is None:
        yield None
        return
    tap = HiddenTap()
    handle = head.register_forward_pre_hook(tap)
    try:
        yield tap
    finally:
        handle.remove()
