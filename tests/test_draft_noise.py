"""Noise-aware drafting under seeded sampling: the noise a draft sees is exactly the seeded rule's, and a seeded
generation hands it to token recycling."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from lookahead import Lookahead, LookaheadConfig
from lookahead.draft_noise import SeededDraftNoise, sampling_temperature
from lookahead.gumbel import gumbel_of_tokens
from lookahead.recycle import NO_NOISE, RecycleDrafter
from lookahead.sampling import gumbel_noise
from tiny_models import build_tiny_model, repetitive_prompt


def test_keys_give_the_seeded_rules_noise_after_the_root_as_it_moves():
    noise = SeededDraftNoise(seed=9, depth=4, temperature=0.5)
    vocab = np.arange(50, dtype=np.int64)
    for root in (10, 11, 13, 13, 20, 3):  # forward by one and by two, standing still, a jump, backwards
        drafted = noise.at(root)
        assert drafted.keys.shape == (4,) and drafted.inv_temp == 2.0
        for depth in range(4):
            out = np.empty(50)
            gumbel_of_tokens(drafted.keys[depth], vocab, out)
            assert np.array_equal(out, gumbel_noise(9, root + 1 + depth, 50).numpy()), (root, depth)


def test_gumbel_noise_hands_out_copies():
    first = gumbel_noise(4, 2, 30)
    first.zero_()
    assert not torch.equal(gumbel_noise(4, 2, 30), first)


def test_sampling_temperature_reads_the_temperature_warper():
    assert sampling_temperature(LogitsProcessorList([TopPLogitsWarper(0.9), TemperatureLogitsWarper(0.7)])) == 0.7
    assert sampling_temperature(LogitsProcessorList([TopPLogitsWarper(0.9)])) == 1.0


def test_a_seeded_generation_drafts_with_its_noise_and_greedy_without(monkeypatch):
    seen = []
    propose = RecycleDrafter.propose

    def spy(self, root, value, max_len, noise=NO_NOISE, inv_temp=1.0, *rest):
        seen.append((noise.shape[0], inv_temp))
        return propose(self, root, value, max_len, noise, inv_temp, *rest)

    monkeypatch.setattr(RecycleDrafter, "propose", spy)
    model = build_tiny_model("llama", dtype=torch.float64, seed=3, vocab=32)
    prompt = repetitive_prompt(1, vocab=32)
    config = LookaheadConfig(seed=5)
    model.generate(prompt, do_sample=True, temperature=0.7, max_new_tokens=12, custom_generate=Lookahead(config))
    assert seen and all(rows == config.max_draft_len and abs(inv - 1 / 0.7) < 1e-9 for rows, inv in seen)
    seen.clear()
    model.generate(prompt, do_sample=False, max_new_tokens=12, custom_generate=Lookahead(config))
    assert seen and all(rows == 0 for rows, _ in seen)
