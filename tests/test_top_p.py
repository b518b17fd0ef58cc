"""Tests for lookahead/top_p.py: `SortedTopP` gives exactly what transformers' `TopPLogitsWarper` gives."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from lookahead.top_p import SortedTopP, faster_warpers

IDS = torch.zeros(1, 3, dtype=torch.long)


def _both(scores: torch.Tensor, top_p: float, keep: int = 1, filter_value: float = -float("inf")):
    reference = TopPLogitsWarper(top_p, filter_value=filter_value, min_tokens_to_keep=keep)
    return reference(IDS, scores.clone()), SortedTopP.like(reference)(IDS, scores.clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999])
def test_bit_identical_to_transformers_on_random_logits(dtype, top_p):
    generator = torch.Generator().manual_seed(int(top_p * 1000))
    for trial in range(20):
        scale = (0.5, 2.0, 8.0)[trial % 3]  # flat to peaked distributions
        scores = (torch.randn(3, 4096, generator=generator) * scale).to(dtype)
        want, got = _both(scores, top_p, keep=1 + trial % 4)
        assert torch.equal(want, got), (top_p, trial)
        assert (got == -float("inf")).any() or top_p > 0.99  # the nucleus cut something: not a vacuous check


def test_bit_identical_after_temperature_and_top_k_and_with_other_filter_values():
    generator = torch.Generator().manual_seed(1)
    for trial in range(30):
        scores = torch.randn(2, 49152, generator=generator) * 3
        scores = TopKLogitsWarper(50 + trial)(IDS, TemperatureLogitsWarper(0.7)(IDS, scores))  # -inf outside top-k
        want, got = _both(scores, 0.95)
        assert torch.equal(want, got)
        want, got = _both(scores, 0.8, filter_value=-1e4)
        assert torch.equal(want, got)


def test_ties_at_the_cut_and_nan_take_transformers_own_path(monkeypatch):
    calls = []
    original = TopPLogitsWarper.__call__
    monkeypatch.setattr(TopPLogitsWarper, "__call__", lambda self, ids, s: calls.append(1) or original(self, ids, s))
    tied = torch.tensor([[0.0, 2.0, 2.0, 2.0]])  # p = 0.5 removes 0 and one of the equal values
    want, got = _both(tied, 0.5)
    assert int((want == -float("inf")).sum()) == 2
    assert torch.equal(want, got) and len(calls) == 2  # the reference, and SortedTopP falling back
    calls.clear()
    distinct = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    want, got = _both(distinct, 0.5)
    assert torch.equal(want, got) and len(calls) == 1  # only the reference: the fast path served it
    calls.clear()
    with_nan = torch.tensor([[0.0, float("nan"), 2.0, 3.0, 4.0]])
    want, got = _both(with_nan, 0.5)
    assert torch.equal(want.isnan(), got.isnan()) and len(calls) == 2


def test_rounded_logits_with_many_ties_still_match():
    generator = torch.Generator().manual_seed(2)
    for trial in range(40):
        scores = torch.randint(-20, 6, (2, 300), generator=generator).float() / 2  # many equal values
        want, got = _both(scores, (0.3, 0.6, 0.9, 0.97)[trial % 4])
        assert torch.equal(want, got)


def test_faster_warpers_swaps_only_plain_top_p_and_keeps_the_order():
    class OwnTopP(TopPLogitsWarper):
        pass

    temperature, top_k, own = TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), OwnTopP(0.5)
    processors = LogitsProcessorList([temperature, TopPLogitsWarper(0.9, min_tokens_to_keep=2), top_k, own])
    swapped = faster_warpers(processors)
    assert swapped is not processors and len(processors) == 4 and type(processors[1]) is TopPLogitsWarper
    assert [type(p) for p in swapped] == [TemperatureLogitsWarper, SortedTopP, TopKLogitsWarper, OwnTopP]
    assert swapped[0] is temperature and swapped[2] is top_k and swapped[3] is own
    assert (swapped[1].top_p, swapped[1].min_tokens_to_keep) == (0.9, 2)
    plain = LogitsProcessorList([temperature])
    assert faster_warpers(plain) is plain


def test_generate_samples_through_it_with_the_same_tokens_and_scores(monkeypatch):
    from tiny_models import build_tiny_model, repetitive_prompt

    from lookahead import Lookahead, LookaheadConfig, hf
    from lookahead.cost_curve import CostCurve

    calls = []
    fast_call = SortedTopP.__call__
    monkeypatch.setattr(SortedTopP, "__call__", lambda self, ids, s: calls.append(1) or fast_call(self, ids, s))
    model = build_tiny_model("llama", dtype=torch.float32, seed=4, vocab=64)
    prompt = repetitive_prompt(2, vocab=64)
    settings = dict(do_sample=True, temperature=0.9, top_p=0.8, max_new_tokens=16, return_dict_in_generate=True,
                    output_scores=True)

    flat = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.01, 1.02, 1.05, 1.1, 1.2), 0.05)

    def run():  # a fixed curve: the same plans, so the same rows and bit-identical scores, run to run
        return model.generate(prompt, **settings, custom_generate=Lookahead(LookaheadConfig(seed=7), cost_curve=flat))

    fast = run()
    assert calls and fast.sequences.shape[1] - prompt.shape[1] == 16  # the walk's scorer went through SortedTopP
    monkeypatch.setattr(hf, "faster_warpers", lambda processors: processors)
    calls.clear()
    own = run()  # transformers' own warper throughout
    assert not calls
    assert torch.equal(fast.sequences, own.sequences)
    assert all(torch.equal(a, b) for a, b in zip(fast.scores, own.scores)) and len(fast.scores) == 16
