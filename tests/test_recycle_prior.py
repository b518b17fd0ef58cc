"""The recycling prior: counting what a model chooses after each token, its file, seeding a table, and that
generation with it stays exact while drafting from it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt

from lookahead import Lookahead, LookaheadConfig
from lookahead.head_files import save_head
from lookahead.recycle import RecycleTable
from lookahead.recycle_prior import RecyclePrior, build_prior, load_prior, prior_for, save_prior


def _text(ids, argmax):
    return SimpleNamespace(ids=torch.tensor(ids), argmax=torch.tensor(argmax))


def test_build_prior_counts_the_choices_after_each_token_most_frequent_first():
    texts = [_text([1, 2, 1, 3], [5, 6, 5, 7]), _text([1, 1, 3, 9], [4, 4, 7, 2]), _text([2], [8])]
    prior = build_prior(texts, vocab_size=10, k=2, min_count=2)
    assert prior.tokens.tolist() == [1, 2, 3]  # 9 was seen once
    # token 1 chose 5 twice and 4 twice (tie: lower id first); token 2 chose 6 and 8; token 3 chose 7 twice
    assert prior.next.tolist() == [[4, 5], [6, 8], [7, -1]]
    np.testing.assert_allclose(prior.scores, np.log([[2, 2], [1, 1], [2, 1]]) * [[1, 1], [1, 1], [1, 0]])
    assert build_prior(texts, vocab_size=10, k=1, min_count=1).tokens.tolist() == [1, 2, 3, 9]
    outside = build_prior([_text([1, 12, 1], [12, 3, 3])], vocab_size=10, k=2, min_count=1)
    assert outside.tokens.tolist() == [1] and outside.next.tolist() == [[3, -1]]  # ids >= vocab dropped
    with pytest.raises(ValueError, match="non-empty"):
        build_prior([_text([], [])], vocab_size=10)


def test_seed_fills_only_empty_rows_cut_or_padded_to_k():
    table = RecycleTable(3)
    table.ensure(8, 3)
    table.update(np.array([2]), np.array([[7, 6, 5]]), np.array([[3.0, 2.0, 1.0]], dtype=np.float32))
    prior = RecyclePrior(np.array([1, 2, 9], dtype=np.int32), np.array([[4, 3], [1, 1], [0, 0]], dtype=np.int32),
                         np.array([[2.0, 1.0], [5.0, 5.0], [1.0, 1.0]], dtype=np.float32))
    table.seed(prior)
    assert table.table[1].tolist() == [4, 3, -1] and table.scores[1].tolist() == [2.0, 1.0, 0.0]
    assert table.table[2].tolist() == [7, 6, 5]  # verified rows keep what verification stored
    assert table.known_tokens == 2  # token 9 is outside the table's vocabulary
    narrow = RecycleTable(1)
    narrow.ensure(8, 1)
    narrow.seed(prior)
    assert narrow.table[1].tolist() == [4]
    with pytest.raises(ValueError, match="tokens"):
        RecyclePrior(np.array([1]), np.array([[1, 2], [3, 4]]), np.zeros((2, 2)))


def _greedy_prior(model, path, prompts):
    """A prior of `model`'s own greedy continuations of `prompts` (argmax labels teacher-forced), saved at path."""
    texts = []
    for prompt in prompts:
        ids = model.generate(prompt, do_sample=False, max_new_tokens=40)
        with torch.no_grad():
            texts.append(SimpleNamespace(ids=ids[0], argmax=model(ids).logits[0].argmax(-1)))
    save_prior(path, build_prior(texts, model.config.vocab_size, k=4, min_count=1), model, "test")
    return str(path)


def test_prior_file_round_trip_and_errors(tmp_path):
    model, other = build_tiny_model("llama", seed=1), build_tiny_model("llama", seed=2)
    path = _greedy_prior(model, tmp_path / "prior.safetensors", [repetitive_prompt(0)])
    prior = load_prior(path, model)
    assert prior.next.shape[1] == 4 and len(prior.tokens) > 0
    with pytest.raises(ValueError, match="was made for"):
        load_prior(path, other)
    save_head(tmp_path / "head.safetensors", {"w": torch.zeros(1)}, torch.zeros(1), model, "test")
    with pytest.raises(ValueError, match="not a lookahead recycling prior file"):
        load_prior(tmp_path / "head.safetensors", model)
    with pytest.raises(ValueError, match="does not exist"):
        prior_for(model, str(tmp_path / "missing.safetensors"))
    assert prior_for(model, "auto") is None and prior_for(model, "none") is None  # none ships for a random model
    assert prior_for(model, path) is prior_for(model, path)  # loaded once
    wide = RecyclePrior(np.array([1], dtype=np.int32), np.array([[model.config.vocab_size]], dtype=np.int32),
                        np.zeros((1, 1), dtype=np.float32))
    save_prior(tmp_path / "wide.safetensors", wide, model, "test")
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        load_prior(tmp_path / "wide.safetensors", model)
    with pytest.raises(ValueError, match="recycle_prior"):
        LookaheadConfig(recycle_prior="")


RECYCLE_ONLY = dict(window_levels=0, pool_candidates=0, prompt_candidates=0, adaptive=False)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_greedy_with_a_prior_is_plain_greedy_and_drafts_from_it(tmp_path, family):
    model = build_tiny_model(family, dtype=torch.float64, seed=1)
    prompts = [repetitive_prompt(seed) for seed in range(3)]
    path = _greedy_prior(model, tmp_path / "prior.safetensors", prompts)
    per_step = {}
    for spec in (None, path):
        steps = tokens = 0
        for prompt in prompts:
            plain = model.generate(prompt, do_sample=False, max_new_tokens=40)
            decoder = Lookahead(recycle_prior=spec, **RECYCLE_ONLY)  # a fresh, empty table every call
            fast = model.generate(prompt, do_sample=False, max_new_tokens=40, custom_generate=decoder)
            assert torch.equal(plain, fast)
            steps, tokens = steps + decoder.last_stats.steps, tokens + decoder.last_stats.new_tokens
        per_step[spec] = tokens / steps
    assert per_step[path] > per_step[None] + 0.2  # the seeded rows were drafted from and accepted


def test_seeded_sampling_draws_the_same_tokens_with_and_without_a_prior(tmp_path):
    model = build_tiny_model("llama", dtype=torch.float64, seed=1)
    path = _greedy_prior(model, tmp_path / "prior.safetensors", [repetitive_prompt(0)])
    outputs = [model.generate(repetitive_prompt(0), do_sample=True, temperature=0.8, max_new_tokens=32,
                              custom_generate=Lookahead(seed=7, recycle_prior=spec, **RECYCLE_ONLY))
               for spec in (None, path, "none")]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_no_packaged_prior_is_looked_up_for_offloaded_embeddings():
    model = build_tiny_model("llama", seed=1)
    embeddings = model.get_input_embeddings()
    embeddings.weight = torch.nn.Parameter(torch.empty_like(embeddings.weight, device="meta"))
    assert prior_for(model, "auto") is None
