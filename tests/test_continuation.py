"""Continuing from a cache (`past_key_values=`, `cache=` from transformers 5.24; e.g. the next turn of a
conversation): the output equals plain `generate`'s, however the prompt restarts — the whole text with new tokens
appended, the whole text with only its last token uncached, or only the new tokens with a mask over the whole
text."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt

from lookahead import Lookahead, LookaheadConfig
from lookahead.compat import CACHE_KWARG, output_cache
from lookahead.hf import _uncached_length


def _first_turn(model, prompt):
    """The first turn's sequences and cache (plain greedy)."""
    out = model.generate(prompt, do_sample=False, max_new_tokens=12, return_dict_in_generate=True)
    return out.sequences, output_cache(out)


def _restarts(sequences, new):
    """(input_ids, extra generate kwargs) of each way to restart from the first turn's cache."""
    whole = torch.cat([sequences, new], dim=1)
    return {
        "appended": (whole, {}),
        "last_token_uncached": (sequences, {}),
        "new_tokens_with_full_mask": (new, {"attention_mask": torch.ones_like(whole)}),
    }


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("config", [LookaheadConfig(), LookaheadConfig.off()], ids=["lookahead", "off"])
def test_continuing_from_a_cache_is_plain_greedy(family, config):
    model = build_tiny_model(family, dtype=torch.float64, seed=1)
    sequences, cache = _first_turn(model, repetitive_prompt(0))
    new = repetitive_prompt(1, length=7)
    for name, (ids, extra) in _restarts(sequences, new).items():
        plain = model.generate(ids, **{CACHE_KWARG: copy.deepcopy(cache)}, do_sample=False, max_new_tokens=24,
                               return_dict_in_generate=True, **extra)
        fast = model.generate(ids, **{CACHE_KWARG: copy.deepcopy(cache)}, do_sample=False, max_new_tokens=24,
                              return_dict_in_generate=True, custom_generate=Lookahead(config), **extra)
        assert torch.equal(plain.sequences, fast.sequences), name
        assert output_cache(fast).get_seq_length() == output_cache(plain).get_seq_length(), name


def test_seeded_sampling_from_a_cache_draws_what_plain_steps_draw():
    model = build_tiny_model("llama", dtype=torch.float64, seed=1)
    sequences, cache = _first_turn(model, repetitive_prompt(0))
    ids = torch.cat([sequences, repetitive_prompt(1, length=7)], dim=1)
    outputs = [model.generate(ids, **{CACHE_KWARG: copy.deepcopy(cache)}, do_sample=True, max_new_tokens=24,
                              custom_generate=Lookahead(config.with_overrides(seed=5)))
               for config in (LookaheadConfig(), LookaheadConfig.off())]
    assert torch.equal(outputs[0], outputs[1])


def test_uncached_length_follows_transformers_prefill():
    model = build_tiny_model("llama", seed=1)
    sequences, cache = _first_turn(model, repetitive_prompt(0))
    config = model.generation_config
    assert _uncached_length(model, sequences, config, {}) is None  # no cache: the whole prompt
    whole = torch.cat([sequences, sequences[:, :3]], dim=1)
    cached = cache.get_seq_length()
    assert _uncached_length(model, whole, config, {CACHE_KWARG: cache,
                                                   "attention_mask": torch.ones_like(whole)}) == whole.shape[1] - cached
    new = sequences[:, :3]
    assert _uncached_length(model, new, config, {CACHE_KWARG: cache,
                                                 "attention_mask": torch.ones_like(whole)}) is None
    embeds = torch.zeros(1, cached + 2, model.config.hidden_size)
    assert _uncached_length(model, new, config, {CACHE_KWARG: cache, "inputs_embeds": embeds}) == 2
