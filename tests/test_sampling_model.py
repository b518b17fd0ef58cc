"""Sampling through the decoder on tiny random models: exact in law, and seeded runs reproduce themselves.

(b) The joint law of the first two sampled tokens under speculative sampling matches the law computed by
enumeration from the model (chi-square, alpha = 1e-4) — without a seed, i.e. with the seeded rule on a seed
drawn from torch's RNG per generation. Seeded sampling gives the same tokens with and without speculation
(`Lookahead(seed=s)` vs the non-speculative loop with the same seed), and so does unseeded sampling after the
same `torch.manual_seed`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny_models import build_tiny_model, repetitive_prompt

from lookahead import Lookahead, LookaheadConfig

ALPHA = 1e-4
SPECULATE = dict(adaptive=False, tree_budget=24, prompt_candidates=4, max_draft_len=6, window_levels=2,
                 window_columns=3)


def _exact_joint(model, prompt, temperature: float) -> np.ndarray:
    """[V, V] exact P(t1, t2) from the model's softmax(logits / temperature)."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        first = torch.softmax(model(prompt).logits[0, -1].double() / temperature, -1)  # [V]
        both = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab).view(-1, 1)], dim=1)
        second = torch.softmax(model(both).logits[:, -1].double() / temperature, -1)  # [V, V]
    return (first[:, None] * second).numpy()


def test_joint_law_of_first_two_tokens_matches_enumeration():
    model = build_tiny_model("llama", dtype=torch.float64, seed=11, vocab=6)
    prompt = repetitive_prompt(0, vocab=6, length=16)
    expected = _exact_joint(model, prompt, temperature=1.3).reshape(-1)
    torch.manual_seed(1234)
    decoder = Lookahead(LookaheadConfig(**SPECULATE))
    counts, accepted = np.zeros_like(expected), 0
    draws = 1500  # max_new_tokens=3: the second token is a verified draft whenever one is accepted
    for _ in range(draws):
        out = model.generate(prompt, do_sample=True, temperature=1.3, top_k=0, max_new_tokens=3,
                             custom_generate=decoder)
        t1, t2 = out[0, prompt.shape[1]: prompt.shape[1] + 2].tolist()
        counts[t1 * 6 + t2] += 1
        accepted += sum(decoder.last_stats.accepted_by_drafter.values())
    assert accepted > draws // 10, "speculation must really happen for this test to mean anything"
    assert pooled_chisquare_p(counts, expected) > ALPHA


def pooled_chisquare_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value of `counts` [K] against probabilities `expected` [K]; cells expected fewer than 5
    times are pooled into one."""
    draws = counts.sum()
    keep = expected * draws >= 5
    f_obs, f_exp = counts[keep], expected[keep] * draws
    if (~keep).any():
        f_obs, f_exp = np.append(f_obs, counts[~keep].sum()), np.append(f_exp, expected[~keep].sum() * draws)
    return float(chisquare(f_obs, f_exp).pvalue)


RECYCLE_ONLY = dict(SPECULATE, prompt_candidates=0, pool_candidates=0, window_levels=0)


@pytest.mark.parametrize("speculate", [SPECULATE, RECYCLE_ONLY], ids=["all", "recycle_only"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("seed", [0, 7, 123456789])
def test_seeded_sampling_is_identical_with_and_without_speculation(family, seed, speculate):
    model = build_tiny_model(family, dtype=torch.float64, seed=3, vocab=32)
    prompt = repetitive_prompt(seed % 5, vocab=32)
    kwargs = dict(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=40)
    fast = Lookahead(LookaheadConfig(seed=seed, **speculate))
    spec = model.generate(prompt, custom_generate=fast, **kwargs)
    plain = model.generate(prompt, custom_generate=Lookahead(LookaheadConfig.off().with_overrides(seed=seed)),
                           **kwargs)
    assert torch.equal(spec, plain)
    assert sum(fast.last_stats.accepted_by_drafter.values()) > 0


def test_seeds_change_the_draws():
    model = build_tiny_model("llama", dtype=torch.float64, seed=3, vocab=32)
    prompt = repetitive_prompt(1, vocab=32)
    outs = {tuple(model.generate(prompt, do_sample=True, max_new_tokens=20,
                                 custom_generate=Lookahead(seed=s))[0].tolist()) for s in range(4)}
    assert len(outs) > 1


def test_unseeded_sampling_draws_a_seed_so_speculation_does_not_change_the_tokens():
    """Without a seed each sequence draws one from torch's RNG and samples with the seeded rule: after one
    `torch.manual_seed` the tokens are the same with and without speculation (a rule drawing from a generator
    in step order would consume different draws as soon as a drafted child is tried)."""
    model = build_tiny_model("llama", dtype=torch.float64, seed=3, vocab=32)
    prompt = repetitive_prompt(2, vocab=32)
    runs, decoders = [], [Lookahead(LookaheadConfig(**SPECULATE)), Lookahead(LookaheadConfig.off())]
    for decoder in decoders:
        torch.manual_seed(5)
        runs.append(model.generate(prompt, do_sample=True, max_new_tokens=24, custom_generate=decoder))
    assert sum(decoders[0].last_stats.accepted_by_drafter.values()) > 0, "speculation must really happen"
    assert torch.equal(*runs)


def test_unseeded_rules_draw_their_seeds_from_torchs_rng():
    from lookahead.rules import GreedyRule, SampledRule, SeededRule, draws_follow_the_plan, make_rule

    torch.manual_seed(9)
    first, second = make_rule(True, None), make_rule(True, None)
    torch.manual_seed(9)
    again = make_rule(True, None)
    assert isinstance(first, SeededRule) and first.seed == again.seed != second.seed
    assert isinstance(make_rule(True, None, draft_model=True), SampledRule)  # a draft model's q: rejection
    assert isinstance(make_rule(True, 7, draft_model=True), SeededRule) and make_rule(True, 7).seed == 7
    assert isinstance(make_rule(False, None), GreedyRule)
    assert draws_follow_the_plan(True, None, True)
    assert not any(draws_follow_the_plan(*args) for args in ((True, None, False), (True, 7, True), (False, None, True)))


def test_unseeded_sampling_follows_torch_manual_seed():
    model = build_tiny_model("llama", dtype=torch.float64, seed=3, vocab=32)
    prompt = repetitive_prompt(2, vocab=32)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(model.generate(prompt, do_sample=True, max_new_tokens=20, custom_generate=Lookahead()))
    assert torch.equal(*runs)
