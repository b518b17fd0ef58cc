"""Resting the drafters (`rest.py`): the policy on injected step timings — rest only where a plain step is
clearly faster, probe speculation after each rest, back off while resting keeps winning, never when disabled — and
generations that rest on a scripted schedule give exactly the tokens of plain decoding, greedy and seeded."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt

from lookahead import Lookahead, LookaheadConfig, decoder, rest
from lookahead.rest import FIRST_REST, MAX_REST, MIN_SPECULATIVE, PROBE_STEPS, DraftRest

FORWARD = 0.010  # seconds of a one-row forward in the injected timings


def _speculate(policy: DraftRest, steps: int, tokens: int, seconds: float) -> None:
    """`steps` speculative steps committing `tokens` each in `seconds` of wall time (forward: FORWARD)."""
    for _ in range(steps):
        assert not policy.rests()
        policy.record(True, tokens, seconds, FORWARD, FORWARD)


def _rest_length(policy: DraftRest, overhead: float = 1.02) -> int:
    """Take the plain steps of the current rest (each `overhead` times its forward); how many there were."""
    taken = 0
    while policy.rests():
        policy.record(False, 1, FORWARD * overhead, FORWARD, FORWARD)
        taken += 1
    return taken


def test_speculation_that_pays_never_rests():
    policy = DraftRest(True)
    _speculate(policy, 200, 2, 0.014)  # 2 tokens in 1.4 plain forwards
    assert not policy.rests()


def test_speculation_that_does_not_pay_rests_then_probes_and_backs_off():
    policy = DraftRest(True)
    _speculate(policy, MIN_SPECULATIVE - 1, 1, 0.013)  # 1 token per 1.3 forwards: slower than a plain step
    policy.record(True, 1, 0.013, FORWARD, FORWARD)
    assert _rest_length(policy) == FIRST_REST
    periods = []
    for _ in range(4):
        _speculate(policy, PROBE_STEPS, 1, 0.013)  # a probe: still no better
        periods.append(_rest_length(policy))
    assert periods == [min(FIRST_REST * 2 ** (i + 1), MAX_REST) for i in range(4)]


def test_a_probe_that_pays_resumes_speculation_and_the_next_rest_is_short_again():
    policy = DraftRest(True)
    _speculate(policy, MIN_SPECULATIVE, 1, 0.013)
    _rest_length(policy)
    _speculate(policy, PROBE_STEPS, 1, 0.013)
    assert _rest_length(policy) == 2 * FIRST_REST
    _speculate(policy, 40, 2, 0.013)  # the text turned repetitive: speculation pays again
    steps = 0
    while not policy.rests():  # ... and stopped paying: the decayed throughput follows within a few steps
        policy.record(True, 1, 0.013, FORWARD, FORWARD)
        steps += 1
    assert 1 < steps < 25 and _rest_length(policy) == FIRST_REST


def test_a_small_edge_for_plain_steps_is_not_enough_and_measured_plain_cost_counts():
    policy = DraftRest(True)
    _speculate(policy, 50, 1, FORWARD * 1.08)  # plain steps (1.05x their forward before one is timed) ~3% faster
    assert not policy.rests()
    heavy = DraftRest(True)
    heavy.plain_overhead = 1.5  # plain steps measured at 1.5 forwards: speculation at 1.3 is faster
    _speculate(heavy, 50, 1, 0.013)
    assert not heavy.rests()


def test_no_decision_before_a_one_row_forward_was_timed_and_none_when_disabled():
    policy = DraftRest(True)
    for _ in range(50):
        policy.record(True, 1, 0.05, FORWARD, None)
    assert not policy.rests()
    disabled = DraftRest(False)
    for _ in range(50):
        disabled.record(True, 1, 0.05, FORWARD, FORWARD)
    assert not disabled.rests()


class _Scripted(DraftRest):
    """Rests on a fixed schedule (two steps of every three, from the second), whatever the timings."""

    def __init__(self, enabled: bool):
        super().__init__(True)
        self.calls = 0
        self.rested = 0

    def rests(self) -> bool:
        self.calls += 1
        resting = self.calls % 3 != 1
        self.rested += resting
        return resting

    def record(self, *args) -> None:
        pass


@pytest.fixture
def scripted(monkeypatch):
    made = []
    monkeypatch.setattr(decoder, "DraftRest", lambda enabled: made.append(_Scripted(enabled)) or made[-1])
    return made


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("seed", [0, 3])
def test_greedy_generations_that_rest_are_plain_greedy(family, seed, scripted):
    model = build_tiny_model(family, dtype=torch.float64, seed=1)
    prompt = repetitive_prompt(seed)
    plain = model.generate(prompt, do_sample=False, max_new_tokens=40)
    fast = Lookahead(LookaheadConfig())
    out = model.generate(prompt, do_sample=False, max_new_tokens=40, custom_generate=fast)
    assert torch.equal(out, plain)
    assert scripted[-1].rested > 5 and fast.last_stats.mean_tokens_per_step > 1.0  # rested, and speculated too


@pytest.mark.parametrize("seed", [0, 7])
def test_seeded_sampling_that_rests_draws_the_same_tokens(seed, scripted):
    model = build_tiny_model("llama", dtype=torch.float64, seed=3, vocab=32)
    prompt = repetitive_prompt(seed, vocab=32)
    kwargs = dict(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=40)
    out = model.generate(prompt, custom_generate=Lookahead(LookaheadConfig(seed=seed)), **kwargs)
    plain = model.generate(prompt, custom_generate=Lookahead(LookaheadConfig.off().with_overrides(seed=seed)),
                           **kwargs)
    assert torch.equal(out, plain)
    assert scripted[0].rested > 5


def test_the_decoder_enables_resting_only_where_the_plan_may_follow_timings(monkeypatch):
    seen = []
    monkeypatch.setattr(decoder, "DraftRest", lambda enabled: seen.append(enabled) or rest.DraftRest(False))
    model = build_tiny_model("llama", dtype=torch.float64, seed=1)
    prompt = repetitive_prompt(1)
    on = LookaheadConfig(rest_drafters=True)
    model.generate(prompt, do_sample=False, max_new_tokens=8, custom_generate=Lookahead(on))
    model.generate(prompt.repeat(2, 1), do_sample=False, max_new_tokens=8, custom_generate=Lookahead(on))
    model.generate(prompt, do_sample=False, max_new_tokens=8, custom_generate=Lookahead(on, cost_curve=_curve()))
    model.generate(prompt, do_sample=False, max_new_tokens=8,
                   custom_generate=Lookahead(on.with_overrides(adaptive=False)))
    model.generate(prompt, do_sample=False, max_new_tokens=8, custom_generate=Lookahead(LookaheadConfig()))
    assert seen == [True, False, False, False, False]  # the last: off by default


def _curve():
    from lookahead.cost_curve import CURVE_SIZES, CostCurve

    return CostCurve(CURVE_SIZES, (1.0, 1.05, 1.1, 1.2, 1.3, 1.4, 1.7, 2.0, 2.6, 3.2), 0.05)
