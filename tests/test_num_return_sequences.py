"""`num_return_sequences > 1`: transformers repeats each prompt into adjacent batch entries before calling
lookahead; each copy is decoded as its own sequence (own drafters, own random stream, the prompt's prefill
shared). Checked against plain `generate` token for token where its output is deterministic (top_k=1 sampling,
forced draws), in law otherwise (chi-square against enumeration, copies independent, with a negative control),
and seeded copies reproduce themselves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_batch import padded_batch
from test_sampling_model import ALPHA, SPECULATE, _exact_joint, pooled_chisquare_p
from test_scores import OUTPUTS, assert_same_outputs, plain_with_tokens
from tiny_models import build_tiny_model, repetitive_prompt

import lookahead.sequence
from lookahead import Lookahead, LookaheadConfig

BATCH = dict(adaptive=False, tree_budget=12)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("llama", dtype=torch.float32, seed=1)


def prompts(batched: bool) -> dict:
    """generate kwargs for one prompt, or for two left-padded prompts."""
    if not batched:
        return dict(inputs=repetitive_prompt(0))
    ids, mask = padded_batch(lengths=(24, 16))
    return dict(inputs=ids, attention_mask=mask, pad_token_id=0)


def test_greedy_copies_are_refused_as_plain_generate_refuses_them(model):
    kwargs = dict(max_new_tokens=5, do_sample=False, num_return_sequences=2)
    with pytest.raises(ValueError, match="num_return_sequences") as plain:
        model.generate(repetitive_prompt(0), **kwargs)
    with pytest.raises(ValueError, match="num_return_sequences") as ours:
        model.generate(repetitive_prompt(0), custom_generate=Lookahead(), **kwargs)
    assert str(ours.value) == str(plain.value)


@pytest.mark.parametrize("batched", [False, True], ids=["one_prompt", "padded_batch"])
def test_argmax_copies_equal_plain_generate(model, batched):
    """top_k=1 leaves one token to sample: plain `generate` is deterministic, and every copy is greedy."""
    kwargs = dict(**prompts(batched), max_new_tokens=24, do_sample=True, top_k=1, num_return_sequences=3)
    decoder = Lookahead(**BATCH)
    ours = model.generate(custom_generate=decoder, **kwargs)
    plain = model.generate(**kwargs)
    assert ours.shape[0] == plain.shape[0] == kwargs["inputs"].shape[0] * 3
    assert torch.equal(plain, ours)
    assert max(decoder.last_stats.tokens_per_step) > 1, "drafts must be accepted for this test to mean anything"


@pytest.mark.parametrize("batched", [False, True], ids=["one_prompt", "padded_batch"])
def test_sampled_copies_equal_plain_generate_drawing_the_same_tokens(model, batched):
    """Plain `generate` forced to draw lookahead's tokens gives the same sequences, scores and logits: each copy is
    decoded in HF's layout from its own prompt's (shared) prefill."""
    kwargs = dict(**prompts(batched), max_new_tokens=20, do_sample=True, temperature=0.9, num_return_sequences=3,
                  **OUTPUTS)
    torch.manual_seed(0)
    decoder = Lookahead(**BATCH)
    ours = model.generate(custom_generate=decoder, **kwargs)
    inputs = kwargs.pop("inputs")
    assert_same_outputs(plain_with_tokens(model, inputs, ours.sequences, **kwargs), ours)
    assert max(decoder.last_stats.tokens_per_step) > 1


@pytest.mark.parametrize("batched", [False, True], ids=["one_prompt", "padded_batch"])
def test_seeded_copies_equal_the_plain_seeded_loop_differ_and_reproduce(model, batched):
    kwargs = dict(**prompts(batched), max_new_tokens=24, do_sample=True, temperature=0.9, num_return_sequences=3)
    decoder = Lookahead(seed=11, **BATCH)
    ours = model.generate(custom_generate=decoder, **kwargs)
    off = model.generate(custom_generate=Lookahead(LookaheadConfig.off(), seed=11), **kwargs)
    again = model.generate(custom_generate=Lookahead(seed=11, **BATCH), **kwargs)
    assert torch.equal(ours, off) and torch.equal(ours, again)
    for group in ours.view(-1, 3, ours.shape[1]):
        assert len({tuple(copy.tolist()) for copy in group}) == 3, "each copy must be its own draw"
    assert max(decoder.last_stats.tokens_per_step) > 1


def test_copy_seed_keeps_the_seed_for_the_first_copy_and_separates_the_others():
    assert lookahead.sequence.copy_seed(None, 3) is None
    assert lookahead.sequence.copy_seed(5, 0) == 5
    seeds = {lookahead.sequence.copy_seed(2**63 - 1, copy) for copy in range(64)}
    assert len(seeds) == 64 and all(0 <= s < 2**64 for s in seeds)


LAW_COPIES, LAW_DRAWS, LAW_TEMPERATURE = 6, 250, 1.3


def sample_copies(seeded: bool, draws: int) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
    """`draws` generations of `LAW_COPIES` copies of one prompt on a 6-token model: counts [36] of (t1, t2)
    over all copies, counts [36] of (t1 of copy 2i, t1 of copy 2i + 1), the number of accepted drafts, and the
    exact law [6, 6] of (t1, t2)."""
    model = build_tiny_model("llama", dtype=torch.float64, seed=11, vocab=6)
    prompt = repetitive_prompt(0, vocab=6, length=16)
    torch.manual_seed(99)
    joint, pairs, accepted = np.zeros(36), np.zeros(36), 0
    shared = Lookahead(LookaheadConfig(**SPECULATE))
    for draw in range(draws):
        decoder = Lookahead(LookaheadConfig(**SPECULATE), seed=draw) if seeded else shared
        out = model.generate(prompt, do_sample=True, temperature=LAW_TEMPERATURE, top_k=0, max_new_tokens=3,
                             num_return_sequences=LAW_COPIES, custom_generate=decoder)
        new = out[:, prompt.shape[1]:].numpy()
        np.add.at(joint, new[:, 0] * 6 + new[:, 1], 1)
        np.add.at(pairs, new[0::2, 0] * 6 + new[1::2, 0], 1)
        accepted += sum(decoder.last_stats.accepted_by_drafter.values())
    return joint, pairs, accepted, _exact_joint(model, prompt, LAW_TEMPERATURE)


def law_p_values(seeded: bool, draws: int = LAW_DRAWS) -> tuple[float, float]:
    """p-values of: (t1, t2) of every copy against enumeration; t1 of two copies of one prompt against the product
    of the first token's law (the copies are independent draws)."""
    joint, pairs, accepted, exact = sample_copies(seeded, draws)
    assert accepted > draws // 5, "speculation must really happen for this test to mean anything"
    first = exact.sum(axis=1)
    return pooled_chisquare_p(joint, exact.reshape(-1)), pooled_chisquare_p(pairs, np.outer(first, first).reshape(-1))


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_copies_sample_the_target_law_independently(seeded):
    law, independence = law_p_values(seeded)
    assert law > ALPHA and independence > ALPHA


def test_negative_control_copies_sharing_one_seed_are_detected(monkeypatch):
    """Copies drawn with the same noise are all one sample: the independence check must fail."""
    monkeypatch.setattr(lookahead.sequence, "copy_seed", lambda seed, copy: seed)
    _, independence = law_p_values(seeded=True, draws=60)
    assert independence < ALPHA
