"""Sliding-window models well past the window: Mistral (every layer slides), Gemma3 and Qwen2 (sliding and full
layers mixed). Lookahead keeps every slot in a plain growing cache and applies the window in the step masks
(`layout.SlidingWindow`), so greedy output equals plain `generate` token for token (prompt shorter and longer
than the window, left-padded batches, a tree deeper than the window) and seeded sampling equals the
non-speculative loop. Negative control: the same generation without the window masks differs from plain
`generate`. Also the masks themselves against transformers' sliding-window rule (the cache conversion:
test_cache.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_batch import padded_batch
from tiny_models import build_tiny_model, repetitive_prompt
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import sliding_window_causal_mask_function

from lookahead.compat import CACHE_KWARG, output_cache
import lookahead.decoder
from lookahead import Lookahead, LookaheadConfig
from lookahead.layout import SequenceDrafts, SlidingWindow, pack_batch, sliding_window
from lookahead.tree import DraftTree

WINDOW = 8
MODELS = {
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "gemma3-mixed": ("gemma3", {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen2-mixed": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
}
SPECULATE = LookaheadConfig(adaptive=False)  # every step verifies its whole tree: drafts are really tried
DEEP = LookaheadConfig(adaptive=False, max_draft_len=16, tree_budget=40, window_levels=3, window_columns=4)
CPU = torch.device("cpu")


def tiny(name: str, **overrides):
    family, window = MODELS[name]
    return build_tiny_model(family, dtype=torch.float64, seed=2, **{**window, **overrides})


def plain_and_lookahead(model, prompt, config: LookaheadConfig, **kwargs):
    """(plain generate, lookahead generate, the lookahead run's stats) for the same call."""
    plain = model.generate(prompt, **kwargs)
    decoder = Lookahead(config)
    return plain, model.generate(prompt, custom_generate=decoder, **kwargs), decoder.last_stats


def speculated(stats) -> bool:
    """Whether some step committed more than one token (drafts were accepted)."""
    return max(stats.tokens_per_step) > 1


@pytest.mark.parametrize("prompt_len", [5, 24], ids=["prompt_shorter", "prompt_longer"])
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_identical_well_past_the_window(name, prompt_len):
    model = tiny(name)
    for seed in range(3):
        prompt = repetitive_prompt(seed, length=prompt_len)
        plain, ours, stats = plain_and_lookahead(model, prompt, SPECULATE, do_sample=False, max_new_tokens=5 * WINDOW)
        assert torch.equal(plain, ours)
        assert speculated(stats)


@pytest.mark.parametrize("name", ["mistral", "gemma3-mixed"])
def test_tree_and_jacobi_window_deeper_than_the_sliding_window(name):
    """Chains of 16 tokens with a window of 4: a node's own ancestors leave its window, so the sliding mask cuts
    inside the tree block too."""
    model = tiny(name, sliding_window=4)
    longest = 0
    for seed in range(2):
        plain, ours, stats = plain_and_lookahead(model, repetitive_prompt(seed, length=16), DEEP, do_sample=False,
                                                 max_new_tokens=48)
        assert torch.equal(plain, ours)
        longest = max(longest, *stats.tokens_per_step)
    assert longest > 4, "some step must accept a path longer than the window"


@pytest.mark.parametrize("name", list(MODELS))
def test_left_padded_batch_identical_row_by_row(name):
    model = tiny(name)
    ids, mask = padded_batch(lengths=(20, 5, 13))  # longer, shorter than the window, and between
    kwargs = dict(attention_mask=mask, pad_token_id=0, do_sample=False, max_new_tokens=4 * WINDOW)
    plain, ours, stats = plain_and_lookahead(model, ids, SPECULATE, **kwargs)
    assert torch.equal(plain, ours)
    assert speculated(stats)


def test_without_the_window_masks_the_output_differs(monkeypatch):
    """Negative control: full attention over the same cache diverges from plain `generate`, so the tests above
    can fail."""
    model = tiny("mistral")
    monkeypatch.setattr(lookahead.decoder, "sliding_window", lambda config: None)
    prompt = repetitive_prompt(0, length=24)
    plain, ours, _ = plain_and_lookahead(model, prompt, SPECULATE, do_sample=False, max_new_tokens=5 * WINDOW)
    assert not torch.equal(plain, ours)


@pytest.mark.parametrize("name", ["mistral", "qwen2-mixed"])
def test_seeded_sampling_equals_the_non_speculative_loop(name):
    model = tiny(name)
    prompt = repetitive_prompt(1, length=12)
    kwargs = dict(do_sample=True, temperature=0.7, max_new_tokens=5 * WINDOW)
    fast = Lookahead(SPECULATE.with_overrides(seed=5))
    ours = model.generate(prompt, custom_generate=fast, **kwargs)
    off = model.generate(prompt, custom_generate=Lookahead(LookaheadConfig.off().with_overrides(seed=5)), **kwargs)
    assert torch.equal(ours, off)
    assert speculated(fast.last_stats)


def test_returned_cache_holds_every_token_and_continues_plain_generate():
    """The cache `return_dict_in_generate` returns keeps every slot in every layer; plain `generate` continues
    from it as from its own."""
    model = tiny("gemma3-mixed")
    prompt = repetitive_prompt(2, length=12)
    out = model.generate(prompt, do_sample=False, max_new_tokens=30, return_dict_in_generate=True,
                         custom_generate=Lookahead(SPECULATE))
    cache = output_cache(out)
    assert all(isinstance(layer, DynamicLayer) for layer in cache.layers)
    assert cache.get_seq_length() == out.sequences.shape[1] - 1  # the last token is not cached yet
    more = model.generate(out.sequences, **{CACHE_KWARG: cache}, do_sample=False, max_new_tokens=10)
    assert torch.equal(more, model.generate(prompt, do_sample=False, max_new_tokens=40))


# ---------------------------------------------------------------- masks


def test_chain_masks_equal_transformers_sliding_window_rule():
    """A chain (what plain decoding would feed) after a prefix: the sliding mask is transformers' own."""
    prefix_len, size = 11, 4
    tree = DraftTree.from_paths(7, [[1, 2, 3, 4, 5, 6]], [0], budget=10)
    drafts = SequenceDrafts(tree, None, root_position=prefix_len)
    masks = pack_batch([drafts], prefix_len, torch.float32, CPU,
                       SlidingWindow(size, ("full_attention", "sliding_attention"))).attention_mask
    rule = sliding_window_causal_mask_function(size)
    index = torch.tensor  # transformers' mask functions take tensor indices
    expected = np.array([[bool(rule(index(0), index(0), index(prefix_len + q), index(kv)))
                          for kv in range(prefix_len + tree.size)] for q in range(tree.size)])
    assert np.array_equal(masks["sliding_attention"][0, 0].numpy() == 0, expected)
    full = masks["full_attention"][0, 0].numpy() == 0
    assert full[:, :prefix_len].all() and not np.array_equal(full, expected)


def test_sliding_mask_counts_tokens_of_the_own_path_past_padding_and_holes():
    """A tree after a prefix with padding and hole slots: each node sees the `size` latest tokens of its own path
    (counted by its text, never by slots), checked against a brute-force walk."""
    size = 4
    hidden = torch.tensor([True, True, False, False, True, False, False, True, False])  # pad, pad, t0, t1, hole, ..
    text_slots = [2, 3, 5, 6, 8]  # the visible slots: the text before the root, in order
    tree = DraftTree.from_paths(9, [[1, 2, 3, 4], [5, 6]], [0, 0], budget=10)
    root_position = 40
    drafts = SequenceDrafts(tree, None, root_position, hidden)
    mask = pack_batch([drafts], len(hidden), torch.float32, CPU,
                      SlidingWindow(size, ("sliding_attention",))).attention_mask
    seen = mask[0, 0].numpy() == 0
    for node in range(tree.size):
        path = [node]
        while path[-1] != 0:
            path.append(int(tree.parents[path[-1]]))
        columns = [len(hidden) + n for n in reversed(path)]  # root .. node, oldest first
        history = text_slots + columns  # its whole text in order, the node last
        expected = np.zeros(len(hidden) + tree.size, dtype=bool)
        expected[history[-size:]] = True
        assert np.array_equal(seen[node], expected), node


def test_one_mask_while_the_window_cuts_nothing():
    tree = DraftTree.from_paths(7, [[1, 2]], [0], budget=10)
    inputs = pack_batch([SequenceDrafts(tree, None, root_position=3)], 3, torch.float32, CPU,
                        SlidingWindow(8, ("full_attention", "sliding_attention")))
    assert isinstance(inputs.attention_mask, torch.Tensor)


def test_sliding_window_of_model_configs():
    assert sliding_window(tiny("mistral").config) == SlidingWindow(WINDOW, ("sliding_attention",))
    assert sliding_window(tiny("qwen2-mixed").config) == SlidingWindow(WINDOW, ("full_attention",
                                                                                "sliding_attention"))
    assert sliding_window(build_tiny_model("llama").config) is None
    assert sliding_window(build_tiny_model("mistral").config) is None  # sliding_window=None
