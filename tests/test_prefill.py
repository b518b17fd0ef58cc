"""A left-padded batch's prefill prompt by prompt (`prefill.py`): each prompt's states right-aligned in the batch's
cache with zero padding slots, logits and real slots as the padded batched prefill computes them (to rounding),
batched generation through it identical to plain batched `generate`, and the batched prefill kept wherever the
shortcut does not apply (nothing written then)."""

from __future__ import annotations

import pytest
import torch
from test_batch import padded_batch
from tiny_models import build_tiny_model
from transformers import DynamicCache

from lookahead import Lookahead, LookaheadConfig, decoder, prefill
from lookahead.cache import make_compactable
from lookahead.compat import CACHE_KWARG


def _inputs(model, ids, mask, **extra) -> dict:
    """What the decoder's prefill forwards: `prepare_inputs_for_generation` of the padded batch, with the position
    ids `generate` gives left-padded prompts."""
    cache = DynamicCache(config=model.config)
    make_compactable(cache, model.config, 4096, batch_size=ids.shape[0])
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return model.prepare_inputs_for_generation(ids, **{CACHE_KWARG: cache}, attention_mask=mask, use_cache=True,
                                               position_ids=positions, is_first_iteration=True, logits_to_keep=1,
                                               **extra)


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_each_prompt_is_forwarded_alone_into_its_right_aligned_slots(family):
    model = build_tiny_model(family, seed=3)
    ids, mask = padded_batch()
    with torch.no_grad():
        inputs = _inputs(model, ids, mask)
        logits = prefill.prefill_by_prompt(model, inputs, inputs[CACHE_KWARG])
        batched = _inputs(model, ids, mask)
        expected = model(**batched, return_dict=True).logits[:, -1]
        assert logits is not None and logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)  # float64: rounding only
        for b in range(ids.shape[0]):
            real = mask[b].bool()
            alone = DynamicCache()
            model(ids[b, real][None], **{CACHE_KWARG: alone}, use_cache=True)
            for ours, theirs, single in zip(inputs[CACHE_KWARG].layers, batched[CACHE_KWARG].layers,
                                            alone.layers, strict=True):
                assert torch.equal(ours.keys[b, :, real], single.keys[0])
                assert torch.equal(ours.values[b, :, real], single.values[0])
                assert not ours.keys[b, :, ~real].any() and not ours.values[b, :, ~real].any()
                torch.testing.assert_close(ours.keys[b, :, real], theirs.keys[b, :, real], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", ["no-padding", "one-prompt", "sliding-window", "extra-input", "not-empty"])
def test_the_batched_prefill_is_kept_where_the_shortcut_does_not_apply(case):
    family = "mistral" if case == "sliding-window" else "llama"
    extra = {"sliding_window": 4} if case == "sliding-window" else {}
    model = build_tiny_model(family, seed=3, **extra)
    ids, mask = padded_batch()
    if case == "no-padding":
        mask = torch.ones_like(mask)
    if case == "one-prompt":
        ids, mask = ids[:1], mask[:1]
    with torch.no_grad():
        inputs = _inputs(model, ids, mask)
        if case == "extra-input":
            inputs["token_type_ids"] = torch.zeros_like(ids)
        if case == "not-empty":
            model(**_inputs(model, ids, mask) | {CACHE_KWARG: inputs[CACHE_KWARG]})
        before = inputs[CACHE_KWARG].get_seq_length()
        assert prefill.prefill_by_prompt(model, inputs, inputs[CACHE_KWARG]) is None
        assert inputs[CACHE_KWARG].get_seq_length() == before


@pytest.mark.parametrize("config", [LookaheadConfig(), LookaheadConfig.off()], ids=["speculate", "off"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "phi3"])
def test_batched_generation_through_it_is_plain_batched_generate(family, config, monkeypatch):
    calls = []
    real = prefill.prefill_by_prompt
    monkeypatch.setattr(decoder, "prefill_by_prompt", lambda *args: calls.append(out := real(*args)) or out)
    model = build_tiny_model(family, seed=2)
    ids, mask = padded_batch()
    kwargs = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=30, do_sample=False)
    plain = model.generate(ids, **kwargs)
    ours = model.generate(ids, custom_generate=Lookahead(config), **kwargs)
    assert torch.equal(plain, ours)
    assert len(calls) == 1 and calls[0] is not None  # the prompts were prefilled one by one
