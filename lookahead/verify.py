"""Verification of a draft tree against the target's logits → `Verdict`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .tree import DraftTree

# (path tokens from the root's child down to the node, raw logits [V]) -> processed scores [V]
NodeScorer = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    """Outcome of one step.

    tokens: the accepted draft tokens followed by the bonus token (always >= 1 token)
    path:   tree node indices root → last accepted node (path[0] = 0), len(path) = n_accepted + 1
    """

    tokens: list[int]
    path: list[int]

    @property
    def n_accepted(self) -> int:
        """Number of accepted draft tokens (the bonus token not counted)."""
        return len(self.path) - 1


def verify_greedy(tree: DraftTree, logits: torch.Tensor, scorer: NodeScorer | None = None) -> Verdict:
    """Greedy walk: at node v take t = argmax; descend into the child carrying t, else emit t and stop.

    logits: [N, V] raw logits of the tree rows. `scorer` applies the generation config's logits processors
    with the node's true prefix; when None the raw logits are used (all rows' argmax in one call).
    """
    best = logits.argmax(dim=-1).tolist() if scorer is None else None
    node, path, tokens = 0, [0], []
    while True:
        if best is not None:
            token = best[node]
        else:
            token = int(scorer(list(tokens), logits[node]).argmax())
        tokens.append(token)
        child = tree.children[node].get(token)
        if child is None:
            return Verdict(tokens=tokens, path=path)
        path.append(child)
        node = child
