"""Exact sampling over a draft tree: probabilities from processed scores, multi-draft rejection with point-mass
drafts, and reproducible (seeded) Gumbel-max sampling.

Pure functions of probabilities and trees; the decoder supplies `probs_at`, which applies the generation
config's processors and warpers with the node's true prefix and is called only for nodes the walk visits.
"""

from __future__ import annotations

from typing import Callable

import torch

from .tree import DraftTree
from .verify import Verdict, verify_greedy

# (node, path tokens from the root's child down to the node) -> target probabilities at that node [V]
NodeProbs = Callable[[int, list[int]], torch.Tensor]
# node -> (its child token that a draft model sampled from q, that q [V]): the draft-model chain in the tree
SampledDrafts = dict[int, tuple[int, torch.Tensor]]

_MASK64 = (1 << 64) - 1
# Smallest sampling temperature the CLI and the server accept: far below it, scores / temperature overflow
# float32 to +-inf and the softmax has no distribution (`probs_from_scores` raises); 1e-5 is ~argmax already.
MIN_TEMPERATURE = 1e-5


def probs_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """Softmax of processed scores [..., V] -> probabilities [..., V] (float32, or float64 if given float64).

    Tokens masked to -inf by top-k/top-p/min-p/bad-words get probability exactly 0. Raises `ValueError` if a
    row has no finite maximum (every token masked, or a nan/+inf score): no distribution exists then.
    """
    scores = scores if scores.dtype == torch.float64 else scores.float()
    if not torch.isfinite(scores.amax(dim=-1)).all():
        raise ValueError("scores row has every token masked to -inf (or holds nan/+inf): nothing to sample")
    return torch.softmax(scores, dim=-1)


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
    return _inverse_cdf(residual, uniforms[-1])


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


def _inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """Index i with cdf[i-1] <= u * total < cdf[i] for nonnegative `weights` [V] with a positive sum: a draw
    proportional to `weights` when u ~ U[0, 1). (torch.multinomial draws V exponentials: ~6 ms at V = 49k here.)
    """
    cdf = weights.cumsum(0)  # [V]
    index = int(torch.searchsorted(cdf, u * cdf[-1].item(), right=True))
    if index == weights.shape[0]:  # u * total rounded up to total (probability ~2**-53): last token with mass
        index = int(weights.nonzero()[-1])
    return index


def verify_point_mass(tree: DraftTree, probs_at: NodeProbs, generator: torch.Generator,
                      sampled: SampledDrafts | None = None) -> Verdict:
    """Exact speculative sampling over the trie with point-mass drafts (the model-free drafters), plus at the
    nodes in `sampled` a child a draft model sampled from q (tried first, with `sample_with_draft`).

    At node v (starting at the root) draw a token from p_v = probs_at(v, path tokens) with `sample_point_mass`,
    trying v's children in rank order (lower node index first). If the token is a child's, descend and repeat;
    otherwise it is the bonus (from the residual, or from p_v at a leaf) and the walk stops. The emitted
    tokens have exactly the target's law. Returns Verdict(accepted tokens + bonus, root → last accepted node).
    """
    node, path, tokens = 0, [0], []
    while True:
        children = tree.children[node]
        ranked = sorted(children, key=children.get)
        probs = probs_at(node, list(tokens))
        if sampled and node in sampled:
            draft, q = sampled[node]
            token = sample_with_draft(probs, draft, q, [c for c in ranked if c != draft], generator)
        else:
            token = sample_point_mass(probs, ranked, generator)
        tokens.append(token)
        child = children.get(token)
        if child is None:
            return Verdict(tokens=tokens, path=path)
        path.append(child)
        node = child


def _splitmix64(x: int) -> int:
    """SplitMix64 finaliser: a bijection of 64-bit integers with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def gumbel_noise(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel noise [vocab] (float64), a pure function of (seed, position, vocab).

    A CPU `torch.Generator` is seeded with splitmix64(splitmix64(seed) XOR position): for a fixed seed the map
    position -> generator seed is a bijection, so positions never share noise. The noise is drawn on the CPU
    and then moved to `device`, so it is the same on every device. Raises `ValueError` for a negative
    `position` or a `seed` outside [0, 2**64).
    """
    if not 0 <= seed <= _MASK64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    generator = torch.Generator().manual_seed(_splitmix64(_splitmix64(seed) ^ position))
    uniform = torch.rand(vocab, generator=generator, dtype=torch.float64)
    uniform = uniform.clamp_min(torch.finfo(torch.float64).tiny)  # rand is in [0, 1): keep log finite
    return (-torch.log(-torch.log(uniform))).to(device)


def gumbel_scores(probs: torch.Tensor, seed: int, position: int) -> torch.Tensor:
    """log probs + g_position [V] (float64): its argmax is a sample from `probs` [V] (Gumbel-max trick).

    Tokens with probability 0 score -inf and are never drawn.
    """
    return probs.to(torch.float64).log() + gumbel_noise(seed, position, probs.shape[-1], probs.device)


def sample_seeded(probs: torch.Tensor, seed: int, position: int) -> int:
    """Reproducible draw from `probs` [V] for the token at absolute sequence index `position`.

    Identical to the token `verify_seeded` emits at that position from the same probabilities.
    """
    return int(gumbel_scores(probs, seed, position).argmax())


def verify_seeded(tree: DraftTree, probs_at: NodeProbs, seed: int, root_position: int) -> Verdict:
    """Seeded exact sampling over the trie: the greedy walk on log p_v + g_t at every visited node v.

    `root_position` is the absolute index of the root token in the sequence (prompt included, no padding); the
    token emitted at depth d is at index t = root_position + 1 + d and is argmax(log p_v + g_t) — exactly what
    `sample_seeded(p_v, seed, t)` draws in the non-speculative loop, so both loops emit the same tokens.
    Noise at distinct positions is independent, so each emitted token is an exact sample given its prefix.
    """

    def scorer(path_tokens: list[int], _row: torch.Tensor) -> torch.Tensor:
        node = 0
        for token in path_tokens:
            node = tree.children[node][token]
        return gumbel_scores(probs_at(node, list(path_tokens)), seed, root_position + 1 + len(path_tokens))

    # verify_greedy only hands the scorer logits[node]; probabilities come lazily from probs_at instead.
    return verify_greedy(tree, torch.empty(tree.size, 0), scorer)
