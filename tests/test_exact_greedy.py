"""End-to-end exactness: lookahead greedy output is token-identical to plain `model.generate(do_sample=False)`."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_models import build_tiny_model as tiny_model, repetitive_prompt

from lookahead import Lookahead, LookaheadConfig
from lookahead.stats import DecodeStats

CONFIGS = {
    # Single drafters verify every step (adaptive=False): the adaptive planner may rest a drafter, and the
    # guard below needs each one's drafts verified.
    "window_only": dict(window_levels=2, window_columns=4, pool_from_text=False, prompt_candidates=0,
                        recycle_nodes=0, adaptive=False),
    "pool_only": dict(window_levels=0, pool_from_text=True, prompt_candidates=0, recycle_nodes=0, adaptive=False),
    "prompt_only": dict(window_levels=0, pool_candidates=0, recycle_nodes=0),
    "recycle_only": dict(window_levels=0, pool_candidates=0, prompt_candidates=0, adaptive=False),
    "recycle_wide": dict(window_levels=0, pool_candidates=0, prompt_candidates=0, recycle_nodes=64, recycle_k=16,
                         tree_budget=48, adaptive=False),
    "all": dict(),
    "budget_1": dict(tree_budget=1),
    "large_budget": dict(tree_budget=96, max_draft_len=16, prompt_candidates=8, pool_candidates=8,
                         window_levels=3, window_columns=6),
    "off": None,
}


def _config(name: str) -> LookaheadConfig:
    overrides = CONFIGS[name]
    return LookaheadConfig.off() if overrides is None else LookaheadConfig(**overrides)


def _both(model, prompt, config: LookaheadConfig, **kwargs):
    """(plain greedy output, lookahead output, stats) for the same call."""
    plain = model.generate(prompt, do_sample=False, **kwargs)
    decoder = Lookahead(config)
    fast = model.generate(prompt, do_sample=False, custom_generate=decoder, **kwargs)
    return plain, fast, decoder.last_stats


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param, dtype=torch.float64, seed=1)


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_identical_to_plain_greedy(model, config_name, seed):
    prompt = repetitive_prompt(seed)
    plain, fast, stats = _both(model, prompt, _config(config_name), max_new_tokens=48)
    assert torch.equal(plain, fast)
    assert stats.new_tokens == 48
    if config_name == "off":
        assert stats.mean_tokens_per_step == 1.0
    elif config_name == "budget_1":
        assert max(stats.tokens_per_step) <= 2


@pytest.mark.parametrize("config_name", ["prompt_only", "pool_only", "window_only", "recycle_only", "all"])
def test_drafters_really_speculate(model, config_name):
    """Guards the exactness tests above against passing only because nothing was ever drafted."""
    accepted = Counter()
    for seed in range(3):
        _, _, stats = _both(model, repetitive_prompt(seed), _config(config_name), max_new_tokens=48)
        accepted.update(stats.accepted_by_drafter)
    assert sum(accepted.values()) > 0
    if config_name == "recycle_only":
        assert set(accepted) == {"recycle"}


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7, 31])
def test_max_new_tokens_never_overshoots(model, max_new_tokens):
    prompt = repetitive_prompt(3)
    plain, fast, stats = _both(model, prompt, _config("large_budget"), max_new_tokens=max_new_tokens)
    assert torch.equal(plain, fast)
    assert fast.shape[1] == prompt.shape[1] + max_new_tokens


@pytest.mark.parametrize("stop_index", [0, 3, 10, 25])
def test_eos_ends_exactly_where_plain_greedy_does(model, stop_index):
    prompt = repetitive_prompt(4)
    reference = model.generate(prompt, do_sample=False, max_new_tokens=40)[0, prompt.shape[1]:]
    eos = int(reference[stop_index])  # its first occurrence ends generation
    first = int((reference == eos).nonzero()[0])
    plain, fast, _ = _both(model, prompt, _config("large_budget"), max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(plain, fast)
    assert fast.shape[1] == prompt.shape[1] + first + 1


def test_eos_list(model):
    prompt = repetitive_prompt(5)
    reference = model.generate(prompt, do_sample=False, max_new_tokens=40)[0, prompt.shape[1]:].tolist()
    plain, fast, _ = _both(model, prompt, _config("all"), max_new_tokens=40, eos_token_id=reference[12:14])
    assert torch.equal(plain, fast)


@pytest.mark.parametrize("processors", [dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=3),
                                        dict(min_new_tokens=20, eos_token_id=7)])
def test_logits_processors_applied_per_node(model, processors):
    """Processors that depend on the prefix are applied with each tree node's true prefix."""
    for seed in range(3):
        plain, fast, _ = _both(model, repetitive_prompt(seed), _config("large_budget"), max_new_tokens=40,
                               **processors)
        assert torch.equal(plain, fast)


def test_left_padded_prompt_with_attention_mask(model):
    prompt = repetitive_prompt(6)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(prompt)], dim=1)
    plain, fast, _ = _both(model, padded, _config("all"), max_new_tokens=40, attention_mask=mask)
    assert torch.equal(plain, fast)


def test_float32_model_too():
    model = tiny_model("llama", dtype=torch.float32, seed=3, vocab=96, layers=3)
    for seed in range(3):
        plain, fast, _ = _both(model, repetitive_prompt(seed, vocab=96), _config("all"), max_new_tokens=48)
        assert torch.equal(plain, fast)


def test_stats_account_for_every_token(model):
    _, fast, stats = _both(model, repetitive_prompt(7), _config("all"), max_new_tokens=48)
    assert sum(n * c for n, c in stats.tokens_per_step.items()) == stats.step_tokens == 47
    assert stats.steps == sum(stats.tokens_per_step.values())
    assert sum(stats.accepted_by_drafter.values()) == stats.step_tokens - stats.steps
    assert stats.forward_time > 0 and stats.total_time >= stats.forward_time


def test_stats_give_the_speed_after_the_prefill():
    stats = DecodeStats(steps=4, new_tokens=9, step_tokens=8, prefill_time=2.0, total_time=4.0)
    assert stats.tokens_per_second == pytest.approx(2.25) and stats.decode_tokens_per_second == pytest.approx(4.0)
    assert "(2.2 tok/s; 4.0 tok/s after the prefill)" in stats.summary()
    assert stats.as_dict()["decode_tokens_per_second"] == pytest.approx(4.0)
    assert DecodeStats(new_tokens=1, prefill_time=1.0, total_time=1.0).decode_tokens_per_second == 0.0


def test_the_stats_line_counts_in_words():
    assert DecodeStats(steps=4, new_tokens=9, step_tokens=8, total_time=1.0).summary().startswith("9 tokens in ")
    assert ", 4 steps, " in DecodeStats(steps=4, new_tokens=9, step_tokens=8, total_time=1.0).summary()
    one = DecodeStats(steps=1, new_tokens=1, step_tokens=1, total_time=1.0).summary()
    assert one.startswith("1 token in ") and ", 1 step, " in one


@pytest.mark.parametrize("family", ["mistral", "gemma", "phi3", "gpt2"])
def test_more_architectures_identical(family):
    """Mistral (no sliding window), Gemma, Phi-3 and GPT-2 (learned absolute positions, so the per-row
    position_ids of tree and window rows matter)."""
    model = tiny_model(family, dtype=torch.float64, seed=2)
    for seed in range(3):
        plain, fast, stats = _both(model, repetitive_prompt(seed), LookaheadConfig(adaptive=False),
                                   max_new_tokens=40)
        assert torch.equal(plain, fast)
    assert stats.mean_tokens_per_step > 1


SLIDING = [("mistral", {"sliding_window": 128}), ("gemma3", {"sliding_window": 128}),
           ("qwen2", {"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 1})]


@pytest.mark.parametrize("family, overrides", SLIDING, ids=["mistral", "gemma3", "qwen2-mixed"])
def test_sliding_window_models_identical_while_the_generation_fits_the_window(family, overrides):
    """Sliding-window layers (Mistral; Gemma3 and Qwen2 mix them with full layers) equal full attention while
    nothing slides out, so lookahead runs them exactly there."""
    model = tiny_model(family, dtype=torch.float64, seed=2, **overrides)
    for seed in range(3):
        plain, fast, stats = _both(model, repetitive_prompt(seed), LookaheadConfig(adaptive=False),
                                   max_new_tokens=40)
        assert torch.equal(plain, fast)
    assert stats.mean_tokens_per_step > 1


@pytest.mark.parametrize("family, overrides", SLIDING, ids=["mistral", "gemma3", "qwen2-mixed"])
def test_sliding_window_beyond_the_window_identical(family, overrides):
    """What used to be refused (issue 16): a window of 16, a 12-token prompt and 48 new tokens, and a batch. The
    window masks themselves are tested in test_sliding_window.py."""
    model = tiny_model(family, dtype=torch.float64, seed=2, **{**overrides, "sliding_window": 16})
    plain, fast, stats = _both(model, repetitive_prompt(0, length=12), LookaheadConfig(adaptive=False),
                               max_new_tokens=48)
    assert torch.equal(plain, fast)
    assert stats.mean_tokens_per_step > 1
    batch = torch.cat([repetitive_prompt(0), repetitive_prompt(1)])
    plain, fast, _ = _both(model, batch, LookaheadConfig(adaptive=False), max_new_tokens=20)
    assert torch.equal(plain, fast)
