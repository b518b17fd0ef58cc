"""Fill-in-the-middle on `/v1/completions` (`suffix`, see `lookahead.fim`) over real HTTP with the `openai` client.

Tiny random Llamas with a word tokenizer (w0..w124) plus the three FIM tokens of each style, so token ids are
known exactly: the prompt must be `<prefix> prefix <suffix> suffix <middle>` and the answer the middle alone.
"""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI
from server_helpers import one_thread, serving  # noqa: F401  (one_thread: autouse fixture)
from tiny_models import build_tiny_model, word_tokenizer

from lookahead import Lookahead, LookaheadConfig
from lookahead.fim import FIM_STYLES, FimTokens, fim_tokens
from lookahead.server import ServerSettings, create_app

NAME = "tiny-coder"
WORDS = 125  # + 3 FIM tokens = a vocabulary of 128
MODEL_SEED = 4  # a context-free model (below) whose greedy path from <middle> visits 17 tokens before a repeat


def _fim_tokenizer(style: FimTokens):
    tokenizer = word_tokenizer(WORDS)
    tokenizer.add_special_tokens({"additional_special_tokens": [style.prefix, style.suffix, style.middle]})
    return tokenizer


def _words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         custom_generate=Lookahead(LookaheadConfig.off()))
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("style", FIM_STYLES, ids=["qwen", "starcoder"])
def test_fim_tokens_are_found_by_style(style):
    assert fim_tokens(_fim_tokenizer(style)) == style
    assert fim_tokens(word_tokenizer(WORDS)) is None  # "<fim_prefix>" is one (unknown-word) token there: not FIM


@pytest.mark.parametrize("style", FIM_STYLES, ids=["qwen", "starcoder"])
def test_suffix_asks_for_the_middle(style):
    tokenizer = _fim_tokenizer(style)
    model = build_tiny_model(vocab=len(tokenizer), dtype=torch.float64)
    fim_prefix, fim_suffix, fim_middle = (tokenizer.convert_tokens_to_ids(t)
                                          for t in (style.prefix, style.suffix, style.middle))
    prefix, suffix = [5, 6, 7, 8], [9, 10, 11]
    ids = [fim_prefix, *prefix, fim_suffix, *suffix, fim_middle]
    expected = _greedy(model, ids, 12)
    with serving(create_app(model, tokenizer, ServerSettings(model_name=NAME))) as url:
        response = _client(url).completions.create(model=NAME, prompt=_words(prefix), suffix=_words(suffix),
                                                   max_tokens=12)
    assert response.usage.prompt_tokens == len(ids)
    assert response.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def _context_free(model) -> list[int]:
    """Zero every attention output, so the next token depends on the current token alone; returns the greedy
    path from the last token id (the FIM middle token) up to its first repeat, that token excluded."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        following = model(torch.arange(model.config.vocab_size)[:, None]).logits[:, 0].argmax(-1).tolist()
    path = [model.config.vocab_size - 1]
    while following[path[-1]] not in path:
        path.append(following[path[-1]])
    return path[1:]


def test_prompt_lookup_drafts_the_middle_from_the_suffix():
    """The middle often repeats what follows the cursor: the suffix is in the prompt, so prompt lookup drafts it.
    With a context-free model the middle is the same whatever the suffix, so a suffix holding it can be built."""
    tokenizer = _fim_tokenizer(FIM_STYLES[0])
    model = build_tiny_model(vocab=len(tokenizer), dtype=torch.float64, seed=MODEL_SEED)
    middle = _context_free(model)
    assert len(middle) >= 12, "the model's greedy path repeats too soon for this test; pick another MODEL_SEED"
    middle = middle[:12]  # no token twice: only the prompt can draft it
    prefix = [t for t in range(2, WORDS) if t not in middle][:6]
    config = LookaheadConfig(pool_candidates=0, recycle_nodes=0, adaptive=False)  # prompt lookup alone
    with serving(create_app(model, tokenizer, ServerSettings(model_name=NAME, config=config))) as url:
        client = _client(url)

        def ask(suffix: list[int]):
            return client.completions.create(model=NAME, prompt=_words(prefix), suffix=_words(suffix),
                                             max_tokens=len(middle))
        copied, unrelated = ask(middle + prefix), ask(prefix[::-1])
    for response in (copied, unrelated):
        assert response.choices[0].text == _words(middle)
    assert unrelated.model_extra["lookahead"]["tokens_per_step"] == 1  # nothing in the prompt to copy
    stats = copied.model_extra["lookahead"]
    assert stats["tokens_per_step"] >= 3 and stats["accepted_by_drafter"]["prompt"] >= 8, stats
