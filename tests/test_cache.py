"""Tests for lookahead/cache.py. The key test: after a packed tree (+ window) forward on a tiny
random Llama / Qwen2 in fp64, `keep_rows` for an accepted path leaves a cache that gives the same logits and
K/V as a fresh prefill of the committed tokens, for a contiguous path (crop branch) and a non-contiguous one
(gather branch). Also: the tree forward's per-node logits equal sequential forwards, exact `keep_rows`
semantics on a synthetic cache, and `make_compactable` (growing and sliding layers made slab layers, refusals).
The live caches run both as transformers' `DynamicLayer`s and as lookahead's `SlabLayer`s (`cache_layer.py`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache, Llama4TextConfig, LlamaConfig, MistralConfig, Qwen2Config, StaticCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from lookahead.cache import keep_rows, make_compactable
from lookahead.cache_layer import SlabLayer
from lookahead.compat import CACHE_KWARG
from lookahead.jacobi import JacobiWindow
from lookahead.layout import pack
from lookahead.tree import DraftTree

CPU = torch.device("cpu")
ATOL = 1e-9
PROMPT = [3, 17, 42, 8, 23, 5, 60]
ROOT = 11
# nodes: 1:[5] 2:[5,6] 3:[5,6,7] 4:[12] 5:[12,13] 6:[12,9] 7:[12,9,4]
PATHS = [[5, 6, 7], [12, 13], [12, 9, 4]]


def make_tree() -> DraftTree:
    tree = DraftTree.from_paths(ROOT, PATHS, [0, 0, 0], budget=20)
    assert [tree.path_tokens(n) for n in range(tree.size)] == [
        [], [5], [5, 6], [5, 6, 7], [12], [12, 13], [12, 9], [12, 9, 4]]
    return tree


def make_window() -> JacobiWindow:
    window = JacobiWindow(2, 3, seed=0)
    window.reset(np.array([30, 31, 32, 33, 34, 35]))
    return window


def prefill(model, tokens: list[int], slab: bool = False) -> DynamicCache:
    """A cache holding `tokens`; with `slab`, made compactable first (its layers append into slabs)."""
    cache = DynamicCache(config=model.config)
    if slab:
        make_compactable(cache, model.config, 10_000)
        assert all(type(layer) is SlabLayer for layer in cache.layers)
    model(torch.tensor([tokens]), **{CACHE_KWARG: cache}, use_cache=True)
    return cache


def tree_step(model, cache, tree, window, prefix_len, root_position) -> torch.Tensor:
    """One packed forward on `cache`; returns the logits of all rows [T, V]."""
    inputs = pack(tree, window, root_position, prefix_len, None, model.dtype, CPU)
    return model(input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                 attention_mask=inputs.attention_mask, **{CACHE_KWARG: cache}, use_cache=True).logits[0]


def last_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0, -1]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tiny_model):
    return tiny_model(request.param, dtype=torch.float64, seed=1)


@pytest.fixture(params=[False, True], ids=["dynamic-layers", "slab-layers"])
def slab(request):
    return request.param


@torch.no_grad()
def test_tree_forward_logits_equal_sequential_forwards(model, slab):
    tree = make_tree()
    cache = prefill(model, PROMPT, slab)
    logits = tree_step(model, cache, tree, None, len(PROMPT), len(PROMPT))
    assert logits.shape == (tree.size, model.config.vocab_size)
    for node in range(tree.size):
        ref = last_logits(model, PROMPT + [ROOT] + tree.path_tokens(node))
        torch.testing.assert_close(logits[node], ref, rtol=0, atol=ATOL, msg=f"node {node}")


@torch.no_grad()
@pytest.mark.parametrize("with_window", [False, True])
@pytest.mark.parametrize("rows", [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 4], [0, 4, 5], [0, 4, 6, 7]])
def test_keep_rows_then_next_token_matches_fresh_prefill(model, rows, with_window, slab):
    tree, window = make_tree(), make_window() if with_window else None
    prefix_len = len(PROMPT)
    cache = prefill(model, PROMPT, slab)
    tree_step(model, cache, tree, window, prefix_len, prefix_len)
    before = [layer.keys.data_ptr() for layer in cache.layers]

    keep_rows(cache, prefix_len, rows)

    committed = PROMPT + [ROOT] + tree.path_tokens(rows[-1])
    assert cache.get_seq_length() == len(committed) == prefix_len + len(rows)
    if rows == list(range(len(rows))):  # documented: contiguous rows are cropped in place, no copy
        assert [layer.keys.data_ptr() for layer in cache.layers] == before
    fresh = prefill(model, committed)
    for kept, ref in zip(cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(kept.keys, ref.keys, rtol=0, atol=ATOL)
        torch.testing.assert_close(kept.values, ref.values, rtol=0, atol=ATOL)

    bonus = 50
    position = len(committed)
    logits = model(input_ids=torch.tensor([[bonus]]), position_ids=torch.tensor([[position]]),
                   **{CACHE_KWARG: cache}, use_cache=True).logits[0, -1]
    torch.testing.assert_close(logits, last_logits(model, committed + [bonus]), rtol=0, atol=ATOL)


@torch.no_grad()
def test_two_compacted_steps_in_a_row(model, slab):
    """Gather, then a second packed step on the compacted cache, then crop: still a fresh prefill's logits."""
    tree, window = make_tree(), make_window()
    prefix_len = len(PROMPT)
    cache = prefill(model, PROMPT, slab)
    tree_step(model, cache, tree, window, prefix_len, prefix_len)
    keep_rows(cache, prefix_len, [0, 4, 6])  # root 11, accepted 12, 9; bonus 40 becomes the next root
    committed = PROMPT + [ROOT, 12, 9]
    prefix_len = len(committed)

    second = DraftTree.from_paths(40, [[1, 2], [3]], [0, 0], budget=5)  # nodes 1:[1] 2:[1,2] 3:[3]
    logits = tree_step(model, cache, second, window, prefix_len, prefix_len)
    for node in range(second.size):
        ref = last_logits(model, committed + [40] + second.path_tokens(node))
        torch.testing.assert_close(logits[node], ref, rtol=0, atol=ATOL)
    keep_rows(cache, prefix_len, [0, 3])
    committed += [40, 3]
    assert cache.get_seq_length() == len(committed)
    logits = model(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[len(committed)]]),
                   **{CACHE_KWARG: cache}, use_cache=True).logits[0, -1]
    torch.testing.assert_close(logits, last_logits(model, committed + [7]), rtol=0, atol=ATOL)


# ---------------------------------------------------------------- exact semantics on a synthetic cache


def synthetic_cache(prefix_len: int, t: int, layers: int = 3,
                    slab: bool = False) -> tuple[DynamicCache, list[torch.Tensor]]:
    """A DynamicCache whose slot s holds the value s + 1000 * layer (keys) / negated (values); with `slab`, its
    layers are `SlabLayer`s (the prefix appended first, then the t step slots, as a generation does)."""
    cache, expected = DynamicCache(), []
    if slab:
        cache.layers = [SlabLayer() for _ in range(layers)]
    for layer in range(layers):
        slots = torch.arange(prefix_len + t, dtype=torch.float64) + 1000 * layer
        keys = slots.view(1, 1, -1, 1).expand(1, 2, -1, 4).clone()
        for part in (keys[:, :, :prefix_len], keys[:, :, prefix_len:]) if slab else (keys,):
            cache.update(part, -part, layer)
        expected.append(slots)
    return cache, expected


@pytest.mark.parametrize("rows", [[0], [0, 1, 2], [0, 1, 2, 3, 4, 5], [0, 2, 5], [0, 5], [0, 3, 4]])
def test_keep_rows_keeps_exactly_prefix_plus_rows_in_order(rows, slab):
    prefix_len, t = 4, 6
    cache, slots = synthetic_cache(prefix_len, t, slab=slab)
    keep_rows(cache, prefix_len, rows)
    keep = list(range(prefix_len)) + [prefix_len + r for r in rows]
    assert cache.get_seq_length() == len(keep)
    for layer, layer_slots in zip(cache.layers, slots, strict=True):
        assert layer.keys.shape == (1, 2, len(keep), 4)
        expected = layer_slots[keep].view(1, 1, -1, 1).expand(1, 2, -1, 4)
        assert torch.equal(layer.keys, expected)
        assert torch.equal(layer.values, -expected)


def test_keep_rows_with_empty_prefix():
    cache, slots = synthetic_cache(0, 5, layers=1)
    keep_rows(cache, 0, [0, 3])
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0.0, 3.0]
    cache, slots = synthetic_cache(0, 5, layers=1)
    keep_rows(cache, 0, [0, 1])
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0.0, 1.0]


# ---------------------------------------------------------------- make_compactable

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
MISTRAL_SLIDING = MistralConfig(**SMALL, sliding_window=8)
LLAMA4_CHUNKED = Llama4TextConfig(**SMALL, attention_chunk_size=8)


@pytest.mark.parametrize("config", [None, LlamaConfig(**SMALL), Qwen2Config(**SMALL), MISTRAL_SLIDING,
                                    Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8,
                                                max_window_layers=1)],
                         ids=["no-config", "llama", "qwen2", "mistral-sliding", "qwen2-mixed-sliding"])
def test_make_compactable_leaves_only_growing_layers(config):
    cache = DynamicCache(config=config)
    make_compactable(cache, config or LlamaConfig(**SMALL), 10_000, batch_size=4)
    assert all(type(layer) is SlabLayer for layer in cache.layers)
    make_compactable(cache, config or LlamaConfig(**SMALL), 10_000, batch_size=4)  # again: nothing to change
    assert all(type(layer) is SlabLayer for layer in cache.layers)


def test_sliding_layers_become_growing_layers_holding_the_same_states():
    cache = DynamicCache(config=MISTRAL_SLIDING)
    states = torch.randn(1, 2, 6, 8)
    cache.layers[0].update(states, -states)
    make_compactable(cache, MISTRAL_SLIDING, 10_000, batch_size=3)
    assert [type(layer) for layer in cache.layers] == [SlabLayer, SlabLayer]
    assert torch.equal(cache.layers[0].keys, states) and torch.equal(cache.layers[0].values, -states)
    assert not cache.layers[1].is_initialized


def test_chunked_layers_stay_while_the_generation_fits_one_chunk():
    cache = DynamicCache(config=LLAMA4_CHUNKED)
    make_compactable(cache, LLAMA4_CHUNKED, 7)
    assert all(type(layer) is DynamicSlidingWindowLayer for layer in cache.layers)


def slid_cache() -> DynamicCache:
    """A sliding-window cache that saw 11 tokens and keeps the last 7."""
    cache = DynamicCache(config=MISTRAL_SLIDING)
    cache.layers[0].update(torch.randn(1, 2, 11, 8), torch.randn(1, 2, 11, 8))
    return cache


@pytest.mark.parametrize("make, config, slots, batch, message", [
    (lambda: StaticCache(config=LlamaConfig(**SMALL), max_cache_len=32), LlamaConfig(**SMALL), 8, 1, "DynamicCache"),
    (lambda: DynamicCache(config=LLAMA4_CHUNKED), LLAMA4_CHUNKED, 8, 1, "chunk 8"),
    (lambda: DynamicCache(config=LLAMA4_CHUNKED), LLAMA4_CHUNKED, 4, 2, "batch size 1"),
    (slid_cache, MISTRAL_SLIDING, 8, 1, r"dropped tokens \(it saw 11, keeps 7\)"),
    (lambda: ((torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)),), LlamaConfig(**SMALL), 8, 1,
     "DynamicCache"),  # legacy tuple cache
], ids=["static", "chunked", "chunked-batch", "slid", "legacy-tuple"])  # fmt: skip
def test_make_compactable_refuses(make, config, slots, batch, message):
    with pytest.raises(ValueError, match=message):
        make_compactable(make(), config, slots, batch)
