"""Tests for exact sampling: lookahead/sampling.py and the sampling walks of lookahead/verify.py.

Exactness is tested statistically: synthetic targets p(. | context) over vocabularies of 4-6 tokens, hand-built
draft trees, N_DRAWS draws, and a chi-square goodness-of-fit test of the first emitted token and of the first
two (or three) emitted tokens jointly against the exact law computed by enumeration. Each chi-square test uses
ALPHA = 1e-4 with fixed generator seeds, so the suite is deterministic; over the choice of seeds a correct rule
fails a check with probability 1e-4 (17 statistical checks in this file: <= 0.17% in all). Negative controls swap in
deliberately wrong rules and must give p-values below NEGATIVE_P; seeded sampling is also tested as an
equality with the non-speculative seeded loop.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from lookahead import sampling, verify
from lookahead.sampling import gumbel_noise, gumbel_scores, noise_at, probs_from_scores, sample_seeded
from lookahead.verify import sample_point_mass, verify_point_mass, verify_seeded
from lookahead.tree import DraftTree

ALPHA = 1e-4  # per chi-square check: a correct rule fails with probability ALPHA over the choice of seeds
NEGATIVE_P = 1e-12  # a wrong rule must be rejected this decisively
N_DRAWS = 6_000
NEGATIVE_DRAWS = 2_000  # wrong rules give p < 1e-50 already at 1,000 draws
ROOT = 0  # root token of every first-step tree; targets depend only on the emitted tokens


class Target:
    """Synthetic target p(. | emitted tokens) [V] float64: a literal table for chosen contexts, otherwise a
    Dirichlet draw seeded by the context with one token masked to probability 0."""

    def __init__(self, vocab: int, table: dict | None = None, seed: int = 0):
        self.vocab, self.seed = vocab, seed
        self.cache = {ctx: torch.tensor(p, dtype=torch.float64) for ctx, p in (table or {}).items()}
        assert all(abs(float(p.sum()) - 1) < 1e-12 and p.shape == (vocab,) for p in self.cache.values())

    def __call__(self, context: tuple) -> torch.Tensor:
        if context not in self.cache:
            rng = np.random.default_rng([self.seed, len(context), *context])
            p = rng.dirichlet(np.full(self.vocab, 2.0))
            p[rng.integers(self.vocab)] = 0.0
            self.cache[context] = torch.tensor(p / p.sum())
        return self.cache[context]

    def joint(self, n: int) -> dict[tuple, float]:
        """Exact probability of every length-n token sequence."""
        out = {}
        for seq in itertools.product(range(self.vocab), repeat=n):
            prob = 1.0
            for i, token in enumerate(seq):
                prob *= float(self(seq[:i])[token])
            out[seq] = prob
        return out


def tree_of(paths: list) -> DraftTree:
    return DraftTree.from_paths(ROOT, paths, [0] * len(paths), budget=64)


# Trees of the later steps (rooted at the last emitted token) still carry drafts, so step 2 also rejects.
FOLLOW_UP = [[1, 0], [2], [0, 3]]

# name: (vocab, literal target table, first-step draft paths best first, tokens compared jointly)
CASES = {
    "siblings": (5, {(): [0.1, 0.35, 0.25, 0.2, 0.1]}, [[1, 2], [2, 0], [3]], 2),
    "deep_chain": (4, {
        (): [0.1, 0.6, 0.2, 0.1], (1,): [0.1, 0.1, 0.6, 0.2], (1, 2): [0.2, 0.1, 0.1, 0.6],
        (1, 2, 3): [0.6, 0.2, 0.1, 0.1],
    }, [[1, 2, 3, 0, 1]], 3),
    "zero_prob_drafts": (5, {
        (): [0.3, 0.4, 0.0, 0.3, 0.0], (1,): [0.5, 0.2, 0.0, 0.3, 0.0],
    }, [[2, 1], [4], [1, 2], [1, 0]], 2),  # drafts 2, 4 at the root and 2 under [1] have p = 0
    "children_cover_support": (5, {(): [0.5, 0.0, 0.3, 0.2, 0.0]}, [[0], [2], [3, 1]], 2),
    # the root's children are the whole vocabulary: some draft is always accepted at the root
    "wide_covering_vocab": (6, {}, [[0, 1, 2], [0, 1, 3], [1, 4], [2], [3, 3, 3, 3], [4, 0], [5, 5]], 2),
}  # fmt: skip


def draw(case: str, step, n_draws: int = N_DRAWS, checked: int = 500) -> tuple[Counter, Target]:
    """Emit tokens until `n` exist, `n_draws` times; returns counts of the first `n` tokens and the target.

    step(draw_index, tree, probs_at, root_index) -> Verdict. For the first `checked` draws every Verdict is
    checked against its tree, and probs_at must have been called exactly for the path's nodes, with their path
    tokens, in order.
    """
    vocab, table, paths, n = CASES[case]
    target, counts = Target(vocab, table), Counter()
    trees = {(): tree_of(paths)}  # first-step tree, then follow-up trees keyed by their root token
    for i in range(n_draws):
        context: tuple = ()
        while len(context) < n:
            key = context[-1:]
            if key not in trees:
                trees[key] = DraftTree.from_paths(key[0], FOLLOW_UP, [0] * len(FOLLOW_UP), budget=64)
            tree, calls = trees[key], []

            def probs_at(node, path_tokens, context=context, calls=calls):
                calls.append((node, path_tokens))
                return target(context + tuple(path_tokens))

            verdict = step(i, tree, probs_at, len(context))
            if i < checked:
                assert tree.path_tokens(verdict.path[-1]) == verdict.tokens[:-1]
                assert calls == [(node, tree.path_tokens(node)) for node in verdict.path]
            context += tuple(verdict.tokens)
        counts[context[:n]] += 1
    return counts, target


def chi_square_p(counts: Counter, exact: dict[tuple, float]) -> float:
    """Goodness-of-fit p-value of `counts` against `exact` probabilities; 0.0 if an impossible cell occurs.

    Cells expected fewer than 5 times are pooled into one bin so the chi-square approximation holds.
    """
    total = sum(counts.values())
    if any(exact.get(cell, 0.0) == 0.0 for cell in counts):
        return 0.0
    observed, expected, small_obs, small_exp = [], [], 0, 0.0
    for cell, prob in exact.items():
        if prob == 0.0:
            continue
        if prob * total < 5:
            small_obs, small_exp = small_obs + counts[cell], small_exp + prob * total
        else:
            observed.append(counts[cell]), expected.append(prob * total)
    if small_exp > 0:
        observed.append(small_obs), expected.append(small_exp)
    return float(stats.chisquare(observed, expected).pvalue)


def p_values(counts: Counter, target: Target) -> tuple[float, float]:
    """(p-value of the first token, p-value of the first n tokens jointly)."""
    n = len(next(iter(counts)))
    first = Counter()
    for seq, count in counts.items():
        first[seq[:1]] += count
    return chi_square_p(first, target.joint(1)), chi_square_p(counts, target.joint(n))


def point_mass_step(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return lambda i, tree, probs_at, root_index: verify_point_mass(tree, probs_at, generator)


def seeded_step(i, tree, probs_at, root_index):
    return verify_seeded(tree, probs_at, seed=1000 + i, root_index=root_index)


# --- probs_from_scores ---------------------------------------------------------------------------------------


def test_probs_from_scores_masks_and_dtypes():
    scores = torch.tensor([[1.0, -float("inf"), 2.0, 0.5], [-float("inf"), 3.0, -float("inf"), -float("inf")]])
    probs = probs_from_scores(scores.to(torch.bfloat16))
    assert probs.dtype == torch.float32
    assert probs[0, 1] == 0 and probs[1].tolist() == [0.0, 1.0, 0.0, 0.0]
    finite = torch.softmax(torch.tensor([1.0, 2.0, 0.5]), -1)
    torch.testing.assert_close(probs[0, [0, 2, 3]], finite, rtol=1e-2, atol=0)  # bf16 input rounding
    assert probs_from_scores(scores.double()).dtype == torch.float64
    torch.testing.assert_close(probs_from_scores(scores).sum(-1), torch.ones(2))


@pytest.mark.parametrize("row", [[-float("inf")] * 4, [0.0, float("nan"), 0.0, 0.0], [0.0, float("inf"), 0.0, 0.0]])
def test_probs_from_scores_rejects_rows_without_a_distribution(row):
    with pytest.raises(ValueError, match="masked"):
        probs_from_scores(torch.tensor([[0.0, 1.0, 2.0, 3.0], row]))


# --- point-mass rule: literal cases -------------------------------------------------------------------------


def test_point_mass_literal_certainties():
    generator = torch.Generator().manual_seed(0)
    one_hot = torch.tensor([0.0, 0.0, 1.0, 0.0])
    for _ in range(50):
        assert sample_point_mass(one_hot, [0, 1, 2], generator) == 2  # accepted with certainty
        assert sample_point_mass(one_hot, [0, 3], generator) == 2  # both rejected: residual bonus
        assert sample_point_mass(one_hot, [], generator) == 2
    # 2 (p = 0) is rejected; then 0 is accepted with probability 1/2, else 1 with certainty (r(1) = 1 after
    # renormalising): the residual, which is empty, is never reached.
    draws = Counter(sample_point_mass(torch.tensor([0.5, 0.5, 0.0, 0.0]), [2, 0, 1], generator) for _ in range(200))
    assert set(draws) == {0, 1}


def test_point_mass_without_mass_is_an_assertion():
    with pytest.raises(AssertionError, match="residual mass is 0"):
        sample_point_mass(torch.zeros(4), [1, 2], torch.Generator().manual_seed(0))


def test_verify_point_mass_root_only_tree_samples_the_root():
    tree = DraftTree.from_paths(7, [], [], budget=4)
    generator = torch.Generator().manual_seed(0)
    verdict = verify_point_mass(tree, lambda node, path: torch.tensor([0.0, 0.0, 1.0]), generator)
    assert (verdict.tokens, verdict.path, verdict.n_accepted) == ([2], [0], 0)


def test_verify_point_mass_tries_children_in_rank_order(monkeypatch):
    tree = DraftTree.from_paths(9, [[3, 1], [1], [2], [3, 0]], [0] * 4, budget=8)  # root children: 3, 1, 2
    tried = []

    def spy(probs, drafts, generator):
        tried.append(drafts)
        return drafts[0] if drafts else 4

    monkeypatch.setattr(verify, "sample_point_mass", spy)
    verdict = verify_point_mass(tree, lambda node, path: torch.full((5,), 0.2), torch.Generator())
    assert tried == [[3, 1, 2], [1, 0], []]
    assert (verdict.tokens, verdict.path) == ([3, 1, 4], [0, 1, 2])


def test_verify_point_mass_is_reproducible_with_the_same_generator_seed():
    vocab, table, paths, _ = CASES["wide_covering_vocab"]
    target, tree = Target(vocab, table), tree_of(paths)

    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        return [verify_point_mass(tree, lambda v, path: target(tuple(path)), generator).tokens for _ in range(200)]

    assert run(3) == run(3)
    assert run(3) != run(4)


# --- point-mass rule: distribution ------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_point_mass_matches_target_distribution(case):
    counts, target = draw(case, point_mass_step(seed=list(CASES).index(case)))
    p_first, p_joint = p_values(counts, target)
    assert p_first > ALPHA, f"first token: chi-square p = {p_first:.3g}"
    assert p_joint > ALPHA, f"first {len(next(iter(counts)))} tokens: chi-square p = {p_joint:.3g}"


def test_point_mass_accepts_drafts_in_the_distribution_tests():
    # Non-vacuity: in the sibling case drafts are accepted at depth 1 and 2, and sometimes all are rejected.
    vocab, table, paths, _ = CASES["siblings"]
    target, tree, generator = Target(vocab, table), tree_of(paths), torch.Generator().manual_seed(0)
    accepted = Counter(
        verify_point_mass(tree, lambda v, path: target(tuple(path)), generator).n_accepted for _ in range(2000)
    )
    assert accepted[0] > 100 and accepted[1] > 100 and accepted[2] > 50


# --- negative controls: wrong rules in the same harness ----------------------------------------------------


def accept_always(probs, drafts, generator):
    """WRONG: accepts the first draft with probability 1."""
    return drafts[0] if drafts else int(torch.multinomial(probs.double(), 1, generator=generator))


def no_renormalisation(probs, drafts, generator):
    """WRONG: after a rejection, later drafts are accepted with the unnormalised residual r(x)."""
    residual = probs.double().clone()
    for token in drafts:
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(residual[token]):
            return token
        residual[token] = 0.0
    return int(torch.multinomial(residual, 1, generator=generator))


def bonus_from_target(probs, drafts, generator):
    """WRONG: after rejecting every draft, the bonus is sampled from p instead of the residual."""
    residual = probs.double().clone()
    for token in drafts:
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * float(residual.sum()) < float(
            residual[token]
        ):
            return token
        residual[token] = 0.0
    return int(torch.multinomial(probs.double(), 1, generator=generator))


@pytest.mark.parametrize("wrong_rule", [accept_always, no_renormalisation, bonus_from_target])
def test_negative_control_wrong_point_mass_rule_is_detected(monkeypatch, wrong_rule):
    monkeypatch.setattr(verify, "sample_point_mass", wrong_rule)  # verify_point_mass's walk uses the bad rule
    counts, target = draw("siblings", point_mass_step(seed=0), n_draws=NEGATIVE_DRAWS)
    p_first, p_joint = p_values(counts, target)
    print(f"{wrong_rule.__name__}: p_first = {p_first:.3g}, p_joint = {p_joint:.3g}")
    assert p_first < NEGATIVE_P and p_joint < NEGATIVE_P


# --- seeded (Gumbel-max) sampling --------------------------------------------------------------------------


def test_gumbel_noise_is_a_function_of_seed_and_index():
    a = gumbel_noise(5, 17, 64, "cpu")
    assert a.shape == (64,) and a.dtype == torch.float64 and torch.isfinite(a).all()
    assert torch.equal(a, gumbel_noise(5, 17, 64, torch.device("cpu")))
    for other in [(5, 18), (6, 17), (17, 5), (0, 5 ^ 17)]:
        assert not torch.equal(a, gumbel_noise(*other, 64)), other


@pytest.mark.parametrize("seed, index", [(-1, 0), (2**64, 0), (0, -1)])
def test_gumbel_noise_rejects_bad_arguments(seed, index):
    with pytest.raises(ValueError):
        gumbel_noise(seed, index, 4)


def test_gumbel_noise_has_the_gumbel_law():
    noise = torch.cat([gumbel_noise(3, index, 1000) for index in range(10)]).numpy()
    assert stats.kstest(noise, stats.gumbel_r.cdf).pvalue > ALPHA
    # indices are independent: neighbouring indices' noise is uncorrelated; so are neighbouring tokens'
    assert abs(np.corrcoef(noise[:-1000], noise[1000:])[0, 1]) < 0.05
    assert abs(np.corrcoef(noise[:-1], noise[1:])[0, 1]) < 0.05
    # and neighbouring seeds'
    other = torch.cat([gumbel_noise(4, index, 1000) for index in range(10)]).numpy()
    assert abs(np.corrcoef(noise, other)[0, 1]) < 0.05


def test_noise_at_is_the_vocabulary_noise_at_those_tokens():
    tokens = torch.tensor([0, 7, 999, 7, 500])
    assert torch.equal(noise_at(8, 30, tokens), gumbel_noise(8, 30, 1000)[tokens])
    with pytest.raises(ValueError):
        noise_at(8, -1, tokens)


def test_sample_seeded_is_the_gumbel_argmax_and_never_draws_zero_probability():
    probs = torch.tensor([0.0, 0.7, 0.3, 0.0])
    draws = [sample_seeded(probs, seed, 11) for seed in range(300)]
    assert set(draws) == {1, 2}
    assert draws == [int(gumbel_scores(probs, seed, 11).argmax()) for seed in range(300)]
    assert draws == [sample_seeded(probs, seed, 11) for seed in range(300)]  # same seed, same draw
    assert stats.binomtest(draws.count(1), 300, 0.7).pvalue > ALPHA


def sparse_probs(vocab: int, kept: int, seed: int) -> torch.Tensor:
    """Probabilities [vocab] with mass on `kept` random tokens (as after top-p), the rest exactly 0."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.full((vocab,), -math.inf)
    support = torch.randperm(vocab, generator=generator)[:kept]
    scores[support] = torch.randn(kept, generator=generator) * 3
    return probs_from_scores(scores)


@pytest.mark.parametrize("kept", [1, 7, 250])  # 250 of 1000 = the sparse path's largest support
def test_sample_seeded_on_a_sparse_support_is_the_full_gumbel_argmax(kept):
    for seed in range(200):
        probs = sparse_probs(1000, kept, seed)
        assert sample_seeded(probs, seed, 40 + seed) == int(gumbel_scores(probs, seed, 40 + seed).argmax()), seed


@pytest.mark.parametrize("seed, index", [(-1, 0), (2**64, 0), (0, -1)])
def test_sample_seeded_on_a_sparse_support_rejects_bad_seeds_and_indices(seed, index):
    with pytest.raises(ValueError):
        sample_seeded(sparse_probs(1000, 5, 0), seed, index)


def test_sample_seeded_on_a_sparse_support_breaks_ties_like_argmax(monkeypatch):
    # Without noise the scores are log p: equal masses tie, and argmax over the vocabulary takes the first.
    monkeypatch.setattr(sampling, "gumbel_noise", lambda seed, index, vocab, device: torch.zeros(vocab).double())
    monkeypatch.setattr(sampling, "noise_at", lambda seed, index, tokens: torch.zeros(len(tokens)).double())
    probs = torch.zeros(100)
    probs[[90, 12, 55]] = torch.tensor([0.4, 0.4, 0.2])
    assert int(gumbel_scores(probs, 1, 2).argmax()) == 12
    assert sample_seeded(probs, 1, 2) == 12


@pytest.mark.parametrize("case", ["siblings", "deep_chain", "zero_prob_drafts", "wide_covering_vocab"])
def test_verify_seeded_equals_the_plain_seeded_loop(case):
    vocab, table, paths, _ = CASES[case]
    target, tree, root_index = Target(vocab, table), tree_of(paths), 8  # root = 9th token of the sequence
    accepted = Counter()
    for seed in range(300):
        verdict = verify_seeded(tree, lambda v, path: target(tuple(path)), seed, root_index)
        plain: list[int] = []
        for offset in range(len(verdict.tokens)):
            plain.append(sample_seeded(target(tuple(plain)), seed, root_index + 1 + offset))
        assert verdict.tokens == plain, seed
        assert tree.path_tokens(verdict.path[-1]) == verdict.tokens[:-1]
        accepted[verdict.n_accepted] += 1
    assert len(accepted) >= 2 and sum(count for n, count in accepted.items() if n > 0) > 30  # non-vacuous


def test_verify_seeded_depends_on_seed_and_index():
    vocab, table, paths, _ = CASES["siblings"]
    target, tree = Target(vocab, table), tree_of(paths)

    def run(seed, index):
        return verify_seeded(tree, lambda v, path: target(tuple(path)), seed, index).tokens

    assert [run(s, 4) for s in range(50)] == [run(s, 4) for s in range(50)]
    assert len({tuple(run(s, 4)) for s in range(50)}) > 5  # different seeds, different draws
    assert [run(s, 4) for s in range(50)] != [run(s, 5) for s in range(50)]


@pytest.mark.parametrize("case", ["siblings", "deep_chain"])
def test_seeded_matches_target_distribution(case):
    counts, target = draw(case, seeded_step, n_draws=4_000)
    p_first, p_joint = p_values(counts, target)
    assert p_first > ALPHA, f"first token: chi-square p = {p_first:.3g}"
    assert p_joint > ALPHA, f"joint: chi-square p = {p_joint:.3g}"


def test_negative_control_index_independent_noise_is_detected(monkeypatch):
    real, real_at = sampling.gumbel_noise, sampling.noise_at
    # WRONG: the same noise at every index correlates successive tokens.
    monkeypatch.setattr(sampling, "gumbel_noise", lambda seed, index, vocab, device: real(seed, 0, vocab, device))
    monkeypatch.setattr(sampling, "noise_at", lambda seed, index, tokens: real_at(seed, 0, tokens))
    counts, target = draw("siblings", seeded_step, n_draws=NEGATIVE_DRAWS)
    p_first, p_joint = p_values(counts, target)
    print(f"index-independent noise: p_first = {p_first:.3g}, p_joint = {p_joint:.3g}")
    assert p_first > ALPHA  # each token alone is still a correct sample
    assert p_joint < NEGATIVE_P
