"""Which exact rule picks tokens: greedy, sampling (point-mass rejection) or seeded sampling (Gumbel-max).

Each rule chooses the first token after the prefill and walks a verified draft tree. `scorer(path, row)`
applies the generation config's processors and warpers to a node's raw logits with its true prefix (None:
raw logits are final, greedy only).
"""

from __future__ import annotations

import numpy as np
import torch

from .sampling import probs_from_scores, sample, sample_seeded
from .tree import DraftTree
from .verify import NodeProbs, NodeScorer, SampledDrafts, Verdict, verify_greedy, verify_point_mass, verify_seeded


class GreedyRule:
    """argmax at every node: token-identical to `generate(do_sample=False)`."""

    def first(self, scores: torch.Tensor, index: int) -> int:
        """Token at sequence index `index` from its processed scores [V]."""
        return int(scores.argmax())

    def propose(self, scores: torch.Tensor, index: int) -> tuple[int, None]:
        """A draft model's token at `index`: the argmax of its scores [V] (a point-mass draft)."""
        return self.first(scores, index), None

    def walk(self, tree: DraftTree, logits: torch.Tensor, scorer: NodeScorer | None, root_index: int,
             sampled: SampledDrafts | None = None, argmax: np.ndarray | None = None) -> Verdict:
        """Verify `tree` against its rows' raw logits [N, V] (`argmax` [N]: their argmax, when known)."""
        return verify_greedy(tree, logits, scorer, argmax)


class SampledRule:
    """Multi-draft speculative sampling with point-mass drafts; randomness from one seeded generator."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def first(self, scores: torch.Tensor, index: int) -> int:
        """Sample the token at `index` from softmax(scores)."""
        return sample(probs_from_scores(scores), self.generator)

    def propose(self, scores: torch.Tensor, index: int) -> tuple[int, torch.Tensor]:
        """A draft model's token at `index`: a sample from q = softmax(scores [V]); returns (token, q)."""
        q = probs_from_scores(scores)
        return sample(q, self.generator), q

    def walk(self, tree: DraftTree, logits: torch.Tensor, scorer: NodeScorer, root_index: int,
             sampled: SampledDrafts | None = None, argmax: np.ndarray | None = None) -> Verdict:
        """Accept a sampled draft with min(1, p/q), point-mass children with their residual probability; the
        bonus comes from the residual or the leaf (`argmax`: unused, a sampled walk reads probabilities)."""
        return verify_point_mass(tree, _probs_at(tree, logits, scorer), self.generator, sampled)


class SeededRule:
    """Token at sequence index t = argmax(log p + Gumbel noise of (seed, t)): the same tokens with or without
    speculation."""

    def __init__(self, seed: int):
        self.seed = seed

    def first(self, scores: torch.Tensor, index: int) -> int:
        """Gumbel-max draw of the token at `index`."""
        return sample_seeded(probs_from_scores(scores), self.seed, index)

    def propose(self, scores: torch.Tensor, index: int) -> tuple[int, None]:
        """A draft model's token at `index`: the Gumbel-max draw with the target's noise for `index`, so it
        matches the target's token whenever the two argmaxes agree (a point-mass draft)."""
        return self.first(scores, index), None

    def walk(self, tree: DraftTree, logits: torch.Tensor, scorer: NodeScorer, root_index: int,
             sampled: SampledDrafts | None = None, argmax: np.ndarray | None = None) -> Verdict:
        """Greedy walk on the noise-perturbed log-probabilities of each visited node (`argmax`: unused, the raw
        logits' argmax is not the perturbed one)."""
        return verify_seeded(tree, _probs_at(tree, logits, scorer), self.seed, root_index)


def make_rule(do_sample: bool, seed: int | None, draft_model: bool = False):
    """The rule of one sequence: GreedyRule; SeededRule for sampling with a seed; for sampling without one, a
    SeededRule whose seed is drawn from torch's global RNG (so `torch.manual_seed` makes runs repeatable) —
    unless a draft model drafts (`draft_model`), then a SampledRule with a generator seeded the same way.

    Without a seed the output must follow the target's law, not one fixed draw, and both rules do: Gumbel-max
    with fresh noise per index is an exact sample at every index. The seeded draw is the better default for
    model-free drafts: its noise is known before the target scores anything, so drafting can aim at the token
    the draw will pick (noise-aware recycling), and its tokens depend on the seed alone — never on what was
    drafted or on timings, so the planner may follow measured step times. A draft model's chain is sampled
    from its own q; rejection sampling (accept with min(1, p/q)) uses q fully, so it keeps SampledRule."""
    if not do_sample:
        return GreedyRule()
    drawn = seed if seed is not None else int(torch.randint(0, 2**62, (1,)))  # a given seed consumes no RNG
    if draws_follow_the_plan(do_sample, seed, draft_model):
        return SampledRule(torch.Generator().manual_seed(drawn))
    return SeededRule(drawn)


def draws_follow_the_plan(do_sample: bool, seed: int | None, draft_model: bool) -> bool:
    """Whether `make_rule` gives a rule whose random draws depend on the plan (SampledRule draws from one
    generator in step order): its plans must then not follow timings, or `torch.manual_seed` runs would
    differ."""
    return do_sample and seed is None and draft_model


def _probs_at(tree: DraftTree, logits: torch.Tensor, scorer: NodeScorer) -> NodeProbs:
    """probs_at(node, path) for the sampling walks: processed scores of the node's row → probabilities."""
    def probs_at(node: int, path: list[int]) -> torch.Tensor:
        return probs_from_scores(scorer(path, logits[node]))
    return probs_at
