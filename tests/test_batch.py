"""Batch size > 1: left-padded prompts of different lengths give, row by row, exactly plain batched `generate`
(greedy on several families; EOS finishing rows at different steps and the pad fill; a stopping criterion
without EOS, where plain decoding keeps generating stopped rows; seeded sampling; a draft model). Also the
batch step planner and the per-sequence cache compaction with hole slots."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from lookahead import Lookahead, LookaheadConfig
from lookahead.budget import StepPlanner, plan_batch
from lookahead.cost_curve import CostCurve
from lookahead.cache import keep_rows_batched, keep_sequences
from lookahead.drafters import SOURCE_DRAFTER
from lookahead.tree import DraftTree

CONFIGS = {"default": LookaheadConfig(), "full_tree": LookaheadConfig(adaptive=False, tree_budget=12),
           "off": LookaheadConfig.off()}


def padded_batch(lengths=(24, 16, 20, 9), pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts [B, L] with repeated spans (prompt lookup finds matches) and their attention mask."""
    prompts = [repetitive_prompt(seed, length=n)[0] for seed, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt):], mask[b, width - len(prompt):] = prompt, 1
    return ids, mask


def both(model, decoder, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(plain generate, lookahead generate) on the padded batch with `kwargs`."""
    ids, mask = padded_batch()
    kwargs = dict(attention_mask=mask, pad_token_id=0, **kwargs)
    return model.generate(ids, **kwargs), model.generate(ids, custom_generate=decoder, **kwargs)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "gemma", "phi3", "mistral"])
def test_padded_batch_greedy_is_identical_row_by_row(family, config):
    model = build_tiny_model(family, seed=2)
    decoder = Lookahead(CONFIGS[config])
    plain, ours = both(model, decoder, max_new_tokens=30, do_sample=False)
    assert torch.equal(plain, ours)
    if config == "full_tree":
        assert decoder.last_stats.mean_tokens_per_step > 1.2, "the rows must really speculate"


def test_rows_finishing_at_eos_stop_costing_and_are_padded():
    model = build_tiny_model("llama", seed=2)
    ids, mask = padded_batch()
    free = model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=30, do_sample=False)
    eos = int(free[0, ids.shape[1] + 6])  # row 0 emits this early; other rows at other steps (or never)
    decoder = Lookahead(adaptive=False)
    plain, ours = both(model, decoder, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert torch.equal(plain, ours)
    assert (plain[:, ids.shape[1]:] == eos).any(dim=1).sum() >= 1 and plain.shape[1] <= ids.shape[1] + 30
    finished_at = [(row[ids.shape[1]:] == eos).nonzero() for row in plain]
    assert any(len(f) for f in finished_at), "some row must hit EOS for this test to mean anything"


class StopAfterTokens(StoppingCriteria):
    """Stops a row once it generated one of `tokens` (no `eos_token_id` attribute: HF keeps generating it)."""

    def __init__(self, tokens: list[int], prompt_len: int):
        self.tokens, self.prompt_len = torch.tensor(tokens), prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, self.prompt_len:], self.tokens).any(dim=1)


def test_stopping_criterion_without_eos_matches_plain_batched_generate():
    model = build_tiny_model("qwen2", seed=2)
    ids, mask = padded_batch()
    free = model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=30, do_sample=False)
    tokens = [int(free[b, ids.shape[1] + 3 + 4 * b]) for b in range(len(ids))]  # rows stop at different steps
    criteria = StoppingCriteriaList([StopAfterTokens(tokens, ids.shape[1])])
    plain, ours = both(model, Lookahead(adaptive=False), max_new_tokens=30, do_sample=False,
                       stopping_criteria=criteria)
    assert torch.equal(plain, ours) and plain.shape[1] < ids.shape[1] + 30


@pytest.mark.parametrize("seed", [0, 9])
def test_seeded_sampling_batch_equals_the_plain_seeded_loop(seed):
    model = build_tiny_model("llama", seed=3)
    ids, mask = padded_batch()
    kwargs = dict(attention_mask=mask, pad_token_id=0, do_sample=True, temperature=0.8, top_p=0.9,
                  max_new_tokens=30)
    off = model.generate(ids, custom_generate=Lookahead(LookaheadConfig.off(), seed=seed), **kwargs)
    on = model.generate(ids, custom_generate=Lookahead(seed=seed, adaptive=False), **kwargs)
    assert torch.equal(off, on)


def test_batch_with_a_draft_model_and_processors():
    model = build_tiny_model("llama", seed=2, layers=3)
    draft = build_tiny_model("llama", seed=4)
    plain, ours = both(model, Lookahead(draft_model=draft), max_new_tokens=25, do_sample=False,
                       repetition_penalty=1.2)
    assert torch.equal(plain, ours)


def test_batch_of_one_padded_row_and_fp32():
    model = build_tiny_model("llama", dtype=torch.float32, seed=2)
    ids, mask = padded_batch(lengths=(20, 12))
    kwargs = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, custom_generate=Lookahead(), **kwargs))


def test_plan_batch_shrinks_the_tree_when_rows_get_dear():
    """The batch curve (t(B x k rows) / t(B x 1)) is steeper for wider batches: the planner verifies less."""
    tree = DraftTree.from_paths(1, [[2, 3, 4, 5], [6, 7], [8]], [0, 0, 3], budget=16)
    sizes = []
    for batch, ratios in [(2, [1, 1.05, 1.1, 1.2, 1.6]), (4, [1, 1.3, 1.8, 2.6, 4.0]), (8, [1, 1.9, 3.5, 6.8, 13])]:
        curve = CostCurve((1, 2, 4, 8, 16), tuple(ratios), 0.01, batch=batch)
        planners = [StepPlanner(curve, len(SOURCE_DRAFTER), 0) for _ in range(batch)]
        for planner in planners:
            planner.rates.accepted[:] = planner.rates.tested * 0.6
        sizes.append(plan_batch(planners, [tree] * batch, curve)[0].size)
    assert sizes[0] > sizes[-1] == 1 and sizes == sorted(sizes, reverse=True)
    assert plan_batch([StepPlanner(None, len(SOURCE_DRAFTER), 0)], [tree], None)[0] is tree


def test_batch_cost_curve_is_measured_per_batch_size():
    from lookahead.calibration import batch_sizes, measure_cost_curve

    model = build_tiny_model("llama", dtype=torch.float32)
    curve = measure_cost_curve(model, batch_sizes(8), prefixes=(16,), repeats=1, batch=8)
    assert curve.batch == 8 and curve.sizes == (1, 2, 4, 8) and curve.ratios[0] == 1.0
    assert CostCurve.from_json(curve.to_json()) == curve


def _cache(batch: int, slots: int) -> DynamicCache:
    cache = DynamicCache()
    states = torch.arange(batch * slots, dtype=torch.float64).view(batch, 1, slots, 1).expand(batch, 2, slots, 3)
    cache.update(states.clone(), -states.clone(), 0)
    return cache


def test_keep_rows_batched_keeps_each_sequences_rows_and_pads_with_holes():
    cache = _cache(2, 4 + 5)  # prefix 4, step rows 5
    width = keep_rows_batched(cache, 4, [[0, 2, 3], [0]])
    keys = cache.layers[0].keys[:, 0, :, 0]
    assert width == 3 and keys.shape == (2, 7)
    assert keys[0].tolist() == [0, 1, 2, 3, 4, 6, 7]
    assert keys[1, :5].tolist() == [9, 10, 11, 12, 13]  # then two holes
    assert torch.equal(cache.layers[0].values, -cache.layers[0].keys)


def test_keep_rows_batched_crops_when_every_sequence_keeps_a_prefix_of_its_rows():
    cache = _cache(2, 4 + 5)
    assert keep_rows_batched(cache, 4, [[0, 1], [0, 1, 2]]) == 3
    keys = cache.layers[0].keys[:, 0, :, 0]
    assert keys.tolist() == [[0, 1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 13, 14, 15]]  # row 0's third slot: a hole


def test_keep_sequences_drops_batch_entries():
    cache = _cache(3, 2)
    keep_sequences(cache, [2, 0])
    assert cache.layers[0].keys[:, 0, :, 0].tolist() == [[4, 5], [0, 1]]
    assert np.array_equal(cache.layers[0].values.shape, (2, 2, 2, 3))


def test_observed_cost_scales_the_curve_and_stops_a_losing_speculation():
    from lookahead.cost_curve import ObservedCost

    curve = CostCurve((1, 2, 4, 8, 16), (1, 1.05, 1.1, 1.2, 1.6), 0.01, batch=4)
    observed = ObservedCost(curve)
    assert observed.scale() == 1.0 and not observed.has_plain
    observed.record(1, 1.0)
    for _ in range(5):
        observed.record(3, 3.0)  # curve: ratio(3) = 1.075; observed 3.0
    assert observed.has_plain and observed.scale() == pytest.approx((0.5 + 5 * 2.0) / (0.5 + 5 * 0.075))
    tree = DraftTree.from_paths(1, [[2, 3, 4, 5], [6, 7], [8]], [0, 0, 3], budget=16)
    planners = [StepPlanner(curve, len(SOURCE_DRAFTER), 0) for _ in range(4)]
    for planner in planners:
        planner.rates.accepted[:] = planner.rates.tested * 0.6
    assert plan_batch(planners, [tree] * 4, curve)[0].size > 1
    assert plan_batch(planners, [tree] * 4, curve, observed.scale())[0].size == 1
