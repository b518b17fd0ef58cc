"""Verification of a draft tree → `Verdict`: one walk over the trie, with a pick rule per node.

`walk` starts at the root. At node v the pick rule emits the token that follows v's path; if a child of v carries
that token the walk descends into it, otherwise the token is the bonus and the walk stops. The rules, each exact
(README, "Sampling, and why the output is exact"):

- greedy (`verify_greedy`): the argmax of v's processed scores;
- point-mass rejection (`verify_point_mass`, `sample_point_mass`): v's children tried in rank order, each accepted
  with its residual probability, the bonus drawn from what is left;
- min(1, p/q) (`sample_with_draft`): at a node whose child a draft model sampled from q, that child first, then
  point-mass rejection of the others against the residual norm(max(0, p - q));
- seeded Gumbel-max (`verify_seeded`): the draw `sampling.sample_seeded` makes for the token's sequence index.

The distributions, plain draws and noise the rules use live in `sampling.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .sampling import inverse_cdf, sample_seeded
from .tree import DraftTree

# (path tokens from the root's child down to the node, the node's raw logits [V]) -> processed scores [V]
NodeScorer = Callable[[list[int], torch.Tensor], torch.Tensor]
# (node, path tokens from the root's child down to the node) -> target probabilities at that node [V]
NodeProbs = Callable[[int, list[int]], torch.Tensor]
# (node, path tokens from the root's child down to the node) -> the token emitted after that path
PickRule = Callable[[int, list[int]], int]
# node -> (its child token that a draft model sampled from q, that q [V]): the draft-model chain in the tree
SampledDrafts = dict[int, tuple[int, torch.Tensor]]


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


def walk(tree: DraftTree, pick: PickRule) -> Verdict:
    """Walk `tree` from the root: at node v emit `pick(v, path tokens)`; descend into the child carrying it, else
    stop with it as the bonus. `pick` is called once per visited node, root first, with a fresh list."""
    node, path, tokens = 0, [0], []
    while True:
        token = pick(node, list(tokens))
        tokens.append(token)
        child = tree.children[node].get(token)
        if child is None:
            return Verdict(tokens=tokens, path=path)
        path.append(child)
        node = child


def verify_greedy(tree: DraftTree, logits: torch.Tensor, scorer: NodeScorer | None = None,
                  argmax: np.ndarray | None = None) -> Verdict:
    """Greedy walk: at node v take t = argmax; descend into the child carrying t, else emit t and stop.

    logits: [N, V] raw logits of the tree's rows. `scorer` applies the generation config's logits processors
    with the node's true prefix; when None the raw logits are used (all rows' argmax in one call, or `argmax`
    [N], each row's `logits.argmax(-1)`, when the caller has it: `argmax_of`).
    """
    if scorer is None:
        best = (argmax if argmax is not None else logits.argmax(dim=-1)).tolist()
        return walk(tree, lambda node, path: best[node])
    return walk(tree, lambda node, path: int(scorer(path, logits[node]).argmax()))


def argmax_of(indices: np.ndarray, nan_free: np.ndarray) -> np.ndarray | None:
    """Each row's `torch.argmax` from its top-k token ids [N, k] (best first, ties to the lower id, -1 where a row
    has nothing above -inf) when no row holds a NaN (`nan_free` [N]); None otherwise (argmax picks a NaN, a top-k
    never does) or when a row is all -inf (argmax: token 0): left to argmax itself."""
    if not len(indices) or not indices.shape[1] or not bool(nan_free.all()) or bool((indices[:, 0] < 0).any()):
        return None
    return indices[:, 0]


def verify_point_mass(tree: DraftTree, probs_at: NodeProbs, generator: torch.Generator,
                      sampled: SampledDrafts | None = None) -> Verdict:
    """Exact speculative sampling over the trie with point-mass drafts (the model-free drafters), plus at the
    nodes in `sampled` a child a draft model sampled from q (tried first, with `sample_with_draft`).

    At node v (starting at the root) draw a token from p_v = probs_at(v, path tokens) with `sample_point_mass`,
    trying v's children in rank order (lower node index first). If the token is a child's, descend and repeat;
    otherwise it is the bonus (from the residual, or from p_v at a leaf) and the walk stops. The emitted
    tokens have exactly the target's law. Returns Verdict(accepted tokens + bonus, root → last accepted node).
    """

    def pick(node: int, path: list[int]) -> int:
        children = tree.children[node]
        ranked = sorted(children, key=children.get)
        probs = probs_at(node, path)
        if sampled and node in sampled:
            draft, q = sampled[node]
            return sample_with_draft(probs, draft, q, [c for c in ranked if c != draft], generator)
        return sample_point_mass(probs, ranked, generator)

    return walk(tree, pick)


def verify_seeded(tree: DraftTree, probs_at: NodeProbs, seed: int, root_index: int) -> Verdict:
    """Seeded exact sampling over the trie: at every visited node v the Gumbel-max draw from p_v.

    `root_index` is the root token's index in the sequence's text (prompt included); the token emitted at depth d
    has index t = root_index + 1 + d and is `sample_seeded(p_v, seed, t)` = argmax(log p_v + g_t) — exactly
    what the non-speculative loop draws at index t, so both loops emit the same tokens. Noise at distinct
    indices is independent, so each emitted token is an exact sample given its prefix.
    """
    return walk(tree, lambda node, path: sample_seeded(probs_at(node, path), seed, root_index + 1 + len(path)))


def sample_point_mass(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> int:
    """Draw one token from `probs` [V] by multi-draft rejection against point-mass `drafts` (distinct tokens).

    Try the drafts in order: accept draft x with probability r(x), where r starts as `probs`; on rejection set
    r(x) = 0 and renormalise. If every draft is rejected, the token is drawn from the residual r. The result is
    distributed exactly as `probs`, and it is one of `drafts` iff a draft was accepted (a rejected draft has
    r = 0, so the residual never returns it). With no drafts this is plain sampling from `probs`.
    `generator` (any device) is the only source of randomness: one draw of len(drafts) + 1 uniforms per call.
    """
    residual = probs.to(torch.float64, copy=bool(drafts))  # [V]; drafts are zeroed in this copy
    # One uniform per draft, plus one for the bonus draw.
    uniforms = torch.rand(len(drafts) + 1, generator=generator, dtype=torch.float64, device=generator.device)
    uniforms = uniforms.tolist()
    if drafts:
        index = torch.as_tensor(drafts, device=residual.device)
        draft_mass = residual.index_select(0, index).tolist()
        residual.index_fill_(0, index, 0.0)
        # Normaliser of r before trying draft j: other mass + mass of drafts j.. . Built by additions only, so a
        # tiny residual is not lost to cancellation.
        masses = [residual.sum().item()]
        for p in reversed(draft_mass):
            masses.append(masses[-1] + p)
        masses.reverse()
        for token, p, mass, u in zip(drafts, draft_mass, masses, uniforms):
            assert mass > 0, f"residual mass is 0 before trying draft {token}: probs has no mass"
            if u * mass < p:  # u < r(x), r renormalised
                return token
        assert masses[-1] > 0, "residual mass is 0 after rejecting every draft: impossible unless probs has no mass"
    return inverse_cdf(residual, uniforms[-1])


def sample_with_draft(probs: torch.Tensor, draft: int, q: torch.Tensor, others: list[int],
                      generator: torch.Generator) -> int:
    """Draw one token from `probs` [V] given a draft token `draft` sampled from `q` [V] plus point-mass drafts
    `others` (distinct, not `draft`).

    Accept `draft` with probability min(1, p/q); on rejection the law of the output must be the residual
    norm(max(0, p - q)), which is drawn by `sample_point_mass` over `others` (so a point-mass draft can still be
    accepted). The result is distributed exactly as `probs` for any `others` fixed before this call.
    Raises `ValueError` if q(draft) is 0 (the draft could not have been sampled from q).
    """
    p_x, q_x = float(probs[draft]), float(q[draft])
    if q_x <= 0.0:
        raise ValueError(f"draft token {draft} has probability 0 under its own q: it was not sampled from q")
    u = float(torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device))
    if u * q_x < p_x:  # u < p/q
        return draft
    residual = (probs.to(torch.float64) - q.to(device=probs.device, dtype=torch.float64)).clamp_min_(0.0)
    if not residual.sum() > 0:  # p == q up to rounding: rejection had probability 0
        return draft
    return sample_point_mass(residual, others, generator)
