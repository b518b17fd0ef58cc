"""`PromptCache`: a generation that starts from the kept keys and values of an earlier text forwards only the rest
of its prompt, and its tokens are plain greedy decoding's (and seeded sampling's without the cache)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny_models import FUSED_ARCHITECTURES, build_tiny_model, fused_test_model, repetitive_prompt
from transformers import DynamicCache

from lookahead import Lookahead, LookaheadConfig, load_model
from lookahead.cache_layer import SlabLayer
from lookahead.compat import CACHE_KWARG
from lookahead.prompt_cache import PromptCache, common_prefix, storage_bytes

NEW = 16


def _models():
    """(name, model): every fused tiny architecture (fp32, the compiled steps) and other families (fp64), one with
    sliding-window layers."""
    for name in FUSED_ARCHITECTURES:
        yield name, fused_test_model(name, seed=1)
    for family in ("llama", "gpt2", "gemma", "gemma3"):  # gemma3: sliding-window layers (a window of 16)
        yield f"{family}-fp64", build_tiny_model(family, dtype=torch.float64, seed=2)


MODELS = dict(_models())


@contextlib.contextmanager
def forwarded(model):
    """Yields a list that receives the number of tokens of every forward of `model` while active."""
    lengths = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        yield lengths
    finally:
        handle.remove()


def generate(model, ids: list[int], cache: DynamicCache | None = None, config: LookaheadConfig | None = None,
             **kwargs) -> list[int]:
    """Prompt + new token ids of a lookahead generation of `ids` (from `cache` when given)."""
    prompt = torch.tensor([ids])
    reuse = {} if cache is None else {CACHE_KWARG: cache}
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                         custom_generate=Lookahead(config), **reuse, **{"do_sample": False, **kwargs})
    return out[0].tolist()


def plain(model, ids: list[int]) -> list[int]:
    """Prompt + new token ids of plain greedy `model.generate`."""
    prompt = torch.tensor([ids])
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                          do_sample=False)[0].tolist()


def edits(first: list[int], vocab: int) -> list[tuple[str, list[int], int]]:
    """(what, prompt, tokens the cache should hold for it) after `first` (prompt + output of the first request,
    the cache holding all but its last token): what an editor or a chat client sends next."""
    accepted = first[:len(first) - NEW + 5]  # the prompt and 5 accepted tokens ...
    typed = (first[len(accepted)] + 1) % vocab  # ... then a token of the user's own
    return [("accepted and typed", accepted + [typed, 3], len(accepted)),
            ("the same prompt again", accepted + [typed, 3], len(accepted) + 1),  # held all but its last
            ("edited near the start", first[:4] + [(first[4] + 7) % vocab] + first[5:20], 4),
            ("nothing shared", [(first[0] + 1) % vocab] + first[1:12], 0)]


@pytest.mark.parametrize("name", list(MODELS))
def test_reused_prompts_forward_only_their_rest_and_decode_as_plain_greedy(name):
    model, store = MODELS[name], PromptCache(1 << 30)
    vocab = model.config.vocab_size
    ids = repetitive_prompt(3, vocab=vocab).tolist()[0]
    cache, held = store.take(ids, model.config)
    assert held == 0 and cache.get_seq_length() == 0
    first = generate(model, ids, cache)
    assert first == plain(model, ids)
    assert all(type(layer) is SlabLayer for layer in cache.layers)  # made up front: lookahead's own layers
    assert store.keep(first, cache) and store.info()["tokens"] == len(first) - 1
    for what, prompt, expected in edits(first, vocab):
        cache, held = store.take(prompt, model.config)
        assert held == expected == cache.get_seq_length(), what
        with forwarded(model) as lengths:
            out = generate(model, prompt, cache)
        assert lengths[0] == len(prompt) - held, what  # the prefill: only what the cache does not hold
        assert out == plain(model, prompt), what
        assert store.keep(out, cache)


def test_a_stale_slot_changes_the_output():
    """The identity checks above can fail: a cache holding one slot of another text changes the tokens."""
    model = MODELS["llama-fp64"]
    ids = repetitive_prompt(4).tolist()[0]
    cache = DynamicCache()
    first = generate(model, ids, cache)
    other = first[:10] + [(first[10] + 1) % 64] + first[11:20]
    cache.crop(11 - cache.get_seq_length())  # slot 10 still holds first[10]'s keys and values
    assert generate(model, other, cache) != plain(model, other)


def test_seeded_sampling_draws_the_same_tokens_from_a_reused_prompt():
    model, store = MODELS["llama-fp64"], PromptCache(1 << 30)
    ids = repetitive_prompt(5).tolist()[0]
    sampled = LookaheadConfig(seed=11)
    cache, _ = store.take(ids, model.config)
    first = generate(model, ids, cache, sampled, do_sample=True, top_k=0)
    store.keep(first, cache)
    prompt = first[:len(ids) + 3] + [1, 2]
    cache, held = store.take(prompt, model.config)
    assert held == len(ids) + 3
    again = generate(model, prompt, cache, sampled, do_sample=True, top_k=0)
    assert again == generate(model, prompt, None, sampled, do_sample=True, top_k=0)
    assert again != generate(model, prompt, None, LookaheadConfig(seed=12), do_sample=True, top_k=0)


def test_the_default_model_reuses_an_edited_file():
    """The embedded model (fp32, its compiled steps): a code prompt, then the same file with the first accepted
    tokens and an edit at its end, as an editor re-sends it; each completion as plain greedy decoding's."""
    model, tokenizer = load_model()
    store = PromptCache(1 << 30)
    source = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    ids = tokenizer(source).input_ids
    cache, _ = store.take(ids, model.config)
    first = generate(model, ids, cache)
    store.keep(first, cache)
    for prompt in (first[:len(ids) + 6], tokenizer(tokenizer.decode(first[:len(ids) + 6]) + "  # edited\n").input_ids):
        cache, held = store.take(prompt, model.config)
        assert held >= len(ids) - 1
        out = generate(model, prompt, cache)
        assert out == generate(model, prompt, None, LookaheadConfig.off())
        store.keep(out, cache)


def test_keep_refuses_what_a_generation_of_the_text_cannot_have_left():
    model, store = MODELS["llama-fp64"], PromptCache(1 << 30)
    ids = repetitive_prompt(6).tolist()[0]
    cache = DynamicCache()
    out = generate(model, ids, cache)
    assert not store.keep(out[:10], cache)  # more slots than the text has tokens
    assert not PromptCache(storage_bytes(cache) - 1).keep(out, cache)  # above the bound
    assert not store.keep(out, DynamicCache())  # empty
    assert store.take(out, model.config)[1] == 0
    assert PromptCache(storage_bytes(cache)).keep(out, cache)
    with pytest.raises(ValueError, match="max_bytes"):
        PromptCache(0)


def test_take_hands_the_cache_over_and_needs_two_tokens():
    model, store = MODELS["llama-fp64"], PromptCache(1 << 30)
    ids = repetitive_prompt(7).tolist()[0]
    cache = DynamicCache()
    out = generate(model, ids, cache)
    store.keep(out, cache)
    assert store.take(out[:1], model.config)[1] == 0  # one token: its logits need its own forward
    assert store.take(out, model.config)[1] == len(out) - 1  # handed over: nothing kept
    assert store.take(out, model.config)[1] == 0
    assert store.info() == {"texts": 0, "tokens": 0, "bytes": 0, "max_bytes": 1 << 30}


def test_two_files_alternating_each_reuse_their_own_text():
    model, store = MODELS["llama"], PromptCache(1 << 30)
    a, b = (repetitive_prompt(seed, length=30).tolist()[0] for seed in (8, 9))
    assert a[0] != b[0]
    outs = {}
    for name, ids in (("a", a), ("b", b)):
        cache, _ = store.take(ids, model.config)
        outs[name] = generate(model, ids, cache)
        store.keep(outs[name], cache)
    assert store.info()["texts"] == 2
    for name in ("a", "b", "a"):
        prompt = outs[name][:len(outs[name]) - NEW + 3] + [5]
        cache, held = store.take(prompt, model.config)
        assert held == len(prompt) - 1, name
        out = generate(model, prompt, cache)
        assert out == plain(model, prompt)
        store.keep(out, cache)
        outs[name] = out
    assert store.info()["texts"] == 2


def test_a_short_shared_start_is_copied_and_the_long_text_stays():
    """A conversation sharing only a system prompt with another: it gets a copy of that start, the other's
    cache stays whole."""
    model, store = MODELS["qwen2"], PromptCache(1 << 30)
    first_ids = repetitive_prompt(10, length=40).tolist()[0]
    cache, _ = store.take(first_ids, model.config)
    first = generate(model, first_ids, cache)
    store.keep(first, cache)
    other = first[:6] + [(first[6] + 1) % 64] + first[20:30]
    copy, held = store.take(other, model.config)
    assert held == 6 and copy is not cache and cache.get_seq_length() == len(first) - 1
    out = generate(model, other, copy)
    assert out == plain(model, other)
    store.keep(out, copy)
    assert store.info()["texts"] == 2
    again, held = store.take(first, model.config)
    assert again is cache and held == len(first) - 1


def test_the_least_recently_used_text_goes_first_and_a_text_is_kept_once():
    model = MODELS["llama-fp64"]
    kept = []
    for seed in (11, 12):
        ids = repetitive_prompt(seed).tolist()[0]
        cache = DynamicCache(config=model.config)
        kept.append((generate(model, ids, cache), cache))
    sizes = [storage_bytes(cache) for _, cache in kept]
    store = PromptCache(sum(sizes) - 1)
    for out, cache in kept:
        assert store.keep(out, cache)
    assert store.info()["texts"] == 1 and store.info()["bytes"] == sizes[1]  # the first went
    assert store.take(kept[0][0], model.config)[1] == 0
    store = PromptCache(1 << 30)
    for _ in range(2):
        store.keep(*kept[0])
    assert store.info()["texts"] == 1  # a kept text that the new one starts with goes


@pytest.mark.parametrize("a, b, shared", [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2),
                                          ([1, 2, 3], [1, 5, 3], 1), ([4], [1], 0)])
def test_common_prefix(a, b, shared):
    import numpy as np

    assert common_prefix(np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)) == shared
