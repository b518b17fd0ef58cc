"""Recycled rows per token pair: the bounded hash table, drafting from a pair's row before a token's, the pair
rows of a recycling prior, and that generation with them stays exact while drafting from them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt

from lookahead import Lookahead, LookaheadConfig
from lookahead.drafters import RECYCLE, RECYCLE_PAIR, RECYCLE_SEEDED, Drafters
from lookahead.recycle import RecycleDrafter, RecycleTable
from lookahead.recycle_pairs import PAIR_SLOTS, PROBES, empty_pairs, find_pair, pair_keys, place_pair, seed_pairs
from lookahead.recycle_prior import RecyclePrior, build_prior, load_prior, save_prior

VALUE = np.tile([0.6, 0.3, 0.2, 0.1], (4, 1))


def test_a_key_is_found_where_it_was_placed_and_a_full_window_evicts_only_when_asked():
    keys = empty_pairs(PROBES, 1)[0]  # one window: every key shares it
    assert find_pair(keys, 5) == -1
    slots = [place_pair(keys, key, False) for key in range(10, 10 + PROBES)]
    assert sorted(slots) == list(range(PROBES))
    assert all(find_pair(keys, key) == slot for key, slot in zip(range(10, 10 + PROBES), slots))
    assert place_pair(keys, 11, False) == slots[1]  # a stored key keeps its slot
    assert place_pair(keys, 99, False) == -1 and find_pair(keys, 99) == -1  # full: a seeded row finds no place
    evicted = place_pair(keys, 99, True)  # a verified row evicts the pair at the window's first slot
    assert find_pair(keys, 99) == evicted and sum(find_pair(keys, key) >= 0 for key in range(10, 10 + PROBES)) == 7
    assert find_pair(empty_pairs(0, 1)[0], 5) == -1 and place_pair(empty_pairs(0, 1)[0], 5, True) == -1
    with pytest.raises(ValueError, match="power of two"):
        empty_pairs(12, 1)


def test_pair_keys_and_seeding_fill_only_pairs_not_stored():
    assert pair_keys(np.array([1, -1, 2, 3]), np.array([2, 2, 10, 4]), 10).tolist() == [12, -1, -1, 34]
    keys, nxt, scores, seeded = empty_pairs(64, 3)
    place = place_pair(keys, 12, True)
    nxt[place] = [7, 7, 7]
    written = seed_pairs(keys, nxt, scores, seeded, np.array([12, 34], np.int64),
                         np.array([[1, 2], [5, 6]], np.int32), np.array([[2.0, 1.0], [3.0, 1.0]], np.float32))
    assert written == 1 and nxt[place].tolist() == [7, 7, 7] and not seeded[place]  # the stored pair keeps its row
    assert seeded[find_pair(keys, 34)] and seeded.sum() == 1
    assert nxt[find_pair(keys, 34)].tolist() == [5, 6, -1] and scores[find_pair(keys, 34)].tolist() == [3, 1, 0]


def _drafter(table, pairs=True):
    return RecycleDrafter(table, 16, 3, 8, 3, pairs=pairs)


def _first_tokens(drafter, root, prev):
    paths, classes = drafter.propose(root, VALUE, 3, prev=prev)
    return [int(p[0]) for p, c in zip(paths, classes) if len(p) == 1], classes


def test_a_pair_row_drafts_before_the_token_row_and_deeper_nodes_read_pairs_too():
    table = RecycleTable(3, PAIR_SLOTS)
    drafter = _drafter(table)
    logits = torch.zeros(3, 16)
    logits[0, [4, 5]] = torch.tensor([9.0, 1.0])  # row carrying 2 after 1: next 4
    logits[1, [6, 7]] = torch.tensor([9.0, 1.0])  # row carrying 2 after 3: next 6
    logits[2, [8, 9]] = torch.tensor([9.0, 1.0])  # row carrying 4 after 2: next 8
    drafter.observe(np.array([2, 2, 4]), logits, prev=np.array([1, 3, 2]))
    assert table.table[2, 0] == 6 and table.known_pairs == 3  # the token row holds the later prediction
    first, classes = _first_tokens(drafter, 2, prev=1)
    assert first[0] == 4 and classes[0] >= 4  # the pair (1, 2) knows what follows 2 after 1; a pair class
    paths, _ = drafter.propose(2, VALUE, 3, prev=1)
    assert [4, 8] in [p.tolist() for p in paths]  # below 4 the pair (2, 4)'s row
    assert _first_tokens(drafter, 2, prev=3)[0][0] == 6
    first, classes = _first_tokens(drafter, 2, prev=5)  # an unseen pair: the token's row
    assert first[0] == 6 and classes[0] < 4
    off = _drafter(RecycleTable(3, 0), pairs=False)
    off.observe(np.array([2, 2]), logits[:2], prev=np.array([1, 3]))
    assert off.table.known_pairs == 0 and _first_tokens(off, 2, prev=1)[0][0] == 6


def test_the_table_snapshots_restores_and_clears_its_pair_rows():
    table = RecycleTable(2, 64)
    table.ensure(16, 2)
    table.update(np.array([2]), np.array([[4, 5]]), prev=np.array([1]))
    saved = table.snapshot()
    table.update(np.array([2, 3]), np.array([[6, 7], [8, 9]]), prev=np.array([1, 1]))
    assert table.known_pairs == 2
    table.restore(saved)
    assert table.known_pairs == 1 and table.pairs[1][find_pair(table.pairs[0], 18)].tolist() == [4, 5]
    table.clear()
    assert table.known_pairs == 0 and table.known_tokens == 0
    assert RecycleTable.for_config(LookaheadConfig()).pair_slots == 0  # off by default
    assert RecycleTable.for_config(LookaheadConfig(recycle_pairs=True)).pair_slots == PAIR_SLOTS


def test_drafters_give_pair_row_nodes_their_own_sources():
    config = LookaheadConfig(window_levels=0, pool_candidates=0, prompt_candidates=0, recycle_k=2,
                             recycle_nodes=4, max_draft_len=2, recycle_pairs=True)
    drafters = Drafters(config, 16, np.array([3, 1]))
    logits = torch.zeros(2, 16)
    logits[0, [4, 5]] = torch.tensor([9.0, 1.0])
    logits[1, [6, 7]] = torch.tensor([9.0, 1.0])
    drafters.recycle_rows(np.array([1, 9]), logits, prev=np.array([3, 8]))  # 1 after 3 (the text), 9 after 8
    tree = drafters.draft(1, max_len=2)
    by_path = {tuple(tree.path_tokens(n)): int(tree.source[n]) for n in range(1, tree.size)}
    assert by_path[(4,)] == RECYCLE_PAIR and by_path[(5,)] == RECYCLE_PAIR + 2
    drafters.observe(np.array([3, 1, 9]))  # the root 9 now follows 1: no pair row for (1, 9)
    tree = drafters.draft(9, max_len=2)
    assert {int(s) for s in tree.source[1:]} <= set(range(RECYCLE, RECYCLE + 4))
    prior = RecyclePrior(np.zeros(0, np.int32), np.zeros((0, 2), np.int32), np.zeros((0, 2), np.float32),
                         np.array([1], np.int32), np.array([9], np.int32), np.array([[11, 12]], np.int32),
                         np.array([[1.0, 0.0]], np.float32))
    seeded = Drafters(config, 16, np.array([3, 1, 9]), recycle_prior=prior)
    tree = seeded.draft(9, max_len=2)
    by_path = {tuple(tree.path_tokens(n)): int(tree.source[n]) for n in range(1, tree.size)}
    # a top-1 share of 0.73: not confident (class 1), then the second (class 2)
    assert by_path[(11,)] == RECYCLE_SEEDED + 1 and by_path[(12,)] == RECYCLE_SEEDED + 2
    seeded.recycle_rows(np.array([9]), logits[:1], prev=np.array([1]))  # verified: the pair's row is replaced
    tree = seeded.draft(9, max_len=2)
    assert int(tree.source[tree.children[0][4]]) == RECYCLE_PAIR


def _text(ids, argmax):
    return SimpleNamespace(ids=torch.tensor(ids), argmax=torch.tensor(argmax))


def test_build_prior_counts_pairs_and_the_file_keeps_them(tmp_path):
    texts = [_text([1, 2, 1, 2], [5, 6, 5, 7]), _text([3, 2, 1, 2], [4, 8, 5, 6])]
    prior = build_prior(texts, vocab_size=10, k=2, min_count=2, pair_k=2)
    pairs = {(p, t): row for p, t, row in zip(prior.pair_prev.tolist(), prior.pair_tokens.tolist(),
                                              prior.pair_next.tolist())}
    assert pairs == {(1, 2): [6, 7], (2, 1): [5, -1]}  # (1, 2) chose 6 twice, 7 once; (3, 2) was seen once
    np.testing.assert_allclose(prior.pair_scores[prior.pair_prev == 1], np.log([[2, 1]]))
    assert len(build_prior(texts, vocab_size=10, pair_k=0).pair_tokens) == 0
    model = build_tiny_model("llama", seed=1)
    save_prior(tmp_path / "prior.safetensors", prior, model, "test")
    loaded = load_prior(tmp_path / "prior.safetensors", model)
    assert loaded.pair_tokens.tolist() == prior.pair_tokens.tolist()
    assert loaded.pair_next.tolist() == prior.pair_next.tolist()
    plain = RecyclePrior(prior.tokens, prior.next, prior.scores)  # a file without pair rows still loads
    save_prior(tmp_path / "plain.safetensors", plain, model, "test")
    assert len(load_prior(tmp_path / "plain.safetensors", model).pair_tokens) == 0
    vocab = model.config.vocab_size
    bad = RecyclePrior(prior.tokens, prior.next, prior.scores, np.array([vocab], np.int32), np.array([1], np.int32),
                       np.array([[2, 3]], np.int32), np.zeros((1, 2), np.float32))
    save_prior(tmp_path / "bad.safetensors", bad, model, "test")
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        load_prior(tmp_path / "bad.safetensors", model)
    with pytest.raises(ValueError, match="pair_prev"):
        RecyclePrior(prior.tokens, prior.next, prior.scores, np.array([1, 2], np.int32), np.array([1], np.int32),
                     np.array([[2, 3]], np.int32), np.zeros((1, 2), np.float32))


RECYCLE_ONLY = dict(window_levels=0, pool_candidates=0, prompt_candidates=0, adaptive=False)


def _pairs_only_prior(model, prompts):
    """A prior holding only pair rows, counted in `model`'s own greedy continuations of `prompts`."""
    texts = []
    for prompt in prompts:
        ids = model.generate(prompt, do_sample=False, max_new_tokens=40)
        with torch.no_grad():
            texts.append(SimpleNamespace(ids=ids[0], argmax=model(ids).logits[0].argmax(-1)))
    full = build_prior(texts, model.config.vocab_size, k=4, min_count=1, pair_k=4)
    return RecyclePrior(full.tokens[:0], full.next[:0], full.scores[:0], full.pair_prev, full.pair_tokens,
                        full.pair_next, full.pair_scores)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_greedy_with_pair_rows_is_plain_greedy_and_drafts_from_them(tmp_path, family):
    model = build_tiny_model(family, dtype=torch.float64, seed=1)
    prompts = [repetitive_prompt(seed) for seed in range(3)]
    path = tmp_path / "pairs.safetensors"
    save_prior(path, _pairs_only_prior(model, prompts), model, "test")
    per_step = {}
    for pairs in (False, True):
        steps = tokens = 0
        for prompt in prompts:
            plain = model.generate(prompt, do_sample=False, max_new_tokens=40)
            decoder = Lookahead(recycle_prior=str(path), recycle_pairs=pairs, **RECYCLE_ONLY)  # a fresh table
            fast = model.generate(prompt, do_sample=False, max_new_tokens=40, custom_generate=decoder)
            assert torch.equal(plain, fast)
            steps, tokens = steps + decoder.last_stats.steps, tokens + decoder.last_stats.new_tokens
        per_step[pairs] = tokens / steps
    assert per_step[True] > per_step[False] + 0.2  # the seeded pair rows were drafted from and accepted


def test_seeded_sampling_draws_the_same_tokens_with_and_without_pair_rows():
    model = build_tiny_model("llama", dtype=torch.float64, seed=1)
    outputs = [model.generate(repetitive_prompt(0), do_sample=True, temperature=0.8, max_new_tokens=32,
                              custom_generate=Lookahead(seed=7, recycle_pairs=pairs, **RECYCLE_ONLY))
               for pairs in (False, True)]
    assert torch.equal(outputs[0], outputs[1])
    with pytest.raises(ValueError, match="recycle_pairs"):
        LookaheadConfig(recycle_pairs=1)
