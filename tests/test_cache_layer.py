"""Tests for lookahead/cache_layer.py: a `SlabLayer` holds exactly what transformers' `DynamicLayer` holds through
appends, crops, growth and outside replacements of its states, appends into its slab without copying the cache,
and never writes into tensors it did not allocate."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from lookahead import cache_layer
from lookahead.cache_layer import SlabLayer


def states(rows: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`[2, 3, rows, 4]` keys numbered from `start`, and their negation as values."""
    keys = torch.arange(start, start + 2 * 3 * rows * 4, dtype=torch.float32).view(2, 3, rows, 4)
    return keys, -keys


def assert_same(slab: SlabLayer, plain: DynamicLayer) -> None:
    assert slab.get_seq_length() == plain.get_seq_length()
    assert torch.equal(slab.keys, plain.keys) and torch.equal(slab.values, plain.values)


def test_holds_what_a_dynamic_layer_holds_through_appends_crops_and_growth(monkeypatch):
    monkeypatch.setattr(cache_layer, "MIN_HEADROOM", 2)  # small slabs: the appends below outgrow them
    slab, plain = SlabLayer(), DynamicLayer()
    for step, (rows, crop) in enumerate([(5, 0), (1, 0), (4, -2), (3, -1), (9, 0), (2, -2), (7, 0)]):
        new = states(rows, start=1000 * step)
        out = slab.update(*new)
        assert torch.equal(out[0], plain.update(*new)[0])
        slab.crop(crop)
        plain.crop(crop)
        assert_same(slab, plain)


def test_an_append_within_capacity_writes_into_the_same_storage():
    """The point of the layer: no copy of the cached slots per append (a `torch.cat` would move them)."""
    slab = SlabLayer()
    slab.update(*states(10))
    storage = slab.keys.data_ptr()
    for step in range(5):
        keys, _ = slab.update(*states(3, start=100 * step))
        assert keys.data_ptr() == storage
        slab.crop(-1)
    assert slab.get_seq_length() == 20


def test_states_replaced_from_outside_are_taken_into_a_fresh_slab():
    """`index_select` / `batch_select_indices` replace `keys` with a tensor outside the slab: the next append
    starts from those states, not from the slab's stale ones."""
    slab, plain = SlabLayer(), DynamicLayer()
    for layer in (slab, plain):
        layer.update(*states(6))
        layer.batch_select_indices(torch.tensor([1]))
        layer.keys = layer.keys.index_select(-2, torch.tensor([0, 2, 5]))
        layer.values = layer.values.index_select(-2, torch.tensor([0, 2, 5]))
    new = tuple(s[1:] for s in states(2, start=500))
    slab.update(*new)
    plain.update(*new)
    assert_same(slab, plain)


def test_never_writes_into_states_it_was_given():
    given_keys, given_values = states(4)
    kept_keys, kept_values = given_keys.clone(), given_values.clone()
    plain = DynamicLayer()
    plain.lazy_initialization(given_keys, given_values)
    plain.keys, plain.values = given_keys, given_values
    slab = SlabLayer.holding(plain)
    slab.crop(-2)
    slab.update(*states(3, start=900))  # would overwrite slots 2.. of the given tensors if it wrote in place
    assert torch.equal(given_keys, kept_keys) and torch.equal(given_values, kept_values)
    assert torch.equal(slab.keys[:, :, :2], kept_keys[:, :, :2])
    assert torch.equal(slab.keys[:, :, 2:], states(3, start=900)[0])


def test_holding_an_empty_layer_gives_an_empty_layer():
    slab = SlabLayer.holding(DynamicLayer())
    assert not slab.is_initialized and slab.get_seq_length() == 0
    slab.update(*states(2))
    assert slab.get_seq_length() == 2


def test_reserved_slots_reset_and_crops_keep_the_dynamic_layer_contract():
    """`reserve` and a crop in the slab only move the slot count (the views are made when read); `reset` empties
    the layer as `DynamicLayer.reset` does, and a later append starts afresh."""
    slab, plain = SlabLayer(), DynamicLayer()
    for layer in (slab, plain):
        layer.update(*states(4))
    keys_slab, values_slab = slab.reserve(3)  # the caller writes the 3 new slots itself
    new = states(3, start=700)
    keys_slab[:, :, 4:7].copy_(new[0])
    values_slab[:, :, 4:7].copy_(new[1])
    plain.update(*new)
    assert_same(slab, plain)
    assert slab.keys is slab.keys  # one view per slot count
    for layer in (slab, plain):
        layer.crop(-5)
    assert_same(slab, plain)
    assert slab.keys.data_ptr() == keys_slab.data_ptr()
    try:
        slab.crop(2)
        raise AssertionError("a positive crop was accepted")
    except ValueError:
        pass
    for layer in (slab, plain):
        layer.reset()
        assert layer.keys is None and layer.values is None and layer.get_seq_length() == 0
        layer.update(*states(2, start=50))
    assert_same(slab, plain)
