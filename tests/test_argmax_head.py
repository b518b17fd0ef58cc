"""Tests for lookahead/argmax_head.py: logits from int8 weights and a proven bound keep every row's fp32 argmax."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from lookahead import Lookahead, LookaheadConfig, argmax_head, streamed_gemm
from lookahead.argmax_head import BoundedHead, argmax_logits, bounded_head
from lookahead.packed_linear import packed_linears, set_compact_weights, set_default_rows, set_streamed_rows
from lookahead.warmup_model import q8_0

pytestmark = pytest.mark.skipif(not streamed_gemm.available(), reason="streamed kernel not built on this machine")

STREAMED_ONLY = dict(default_matmul_rows=0, streamed_matmul_rows=16)  # every product on the streamed kernel


def _exact(weight: torch.Tensor):
    """The fp32 head as the streamed kernel computes it: what the bounded logits must agree with."""
    packed = streamed_gemm.pack(weight)
    return lambda x: streamed_gemm.product(x, packed)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0])
def test_argmax_is_the_fp32_argmax_and_other_values_stay_below_the_winner(scale):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3000, 72, generator=gen) * 0.2
    head, exact = BoundedHead(weight), _exact(weight)
    for rows in (1, 3, 16):
        x = torch.randn(rows, 72, generator=gen) * scale
        want, got = exact(x), head.logits(x, exact)
        assert torch.equal(got.argmax(dim=1), want.argmax(dim=1))
        best = want.argmax(dim=1, keepdim=True)
        assert torch.equal(got.gather(1, best), want.gather(1, best))  # the winner's logit is the exact one
        others = got.scatter(1, best, float("-inf"))
        assert bool((others < want.gather(1, best)).all())  # strictly below it: no tie the exact logits lack
        assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())  # the int8 head's values


def _near_tie() -> tuple[torch.Tensor, torch.Tensor]:
    """A head and an input where the int8 rounding alone ranks two tokens the wrong way round: token 1's exact
    logit beats token 0's by less than the rounding error."""
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(1, 64, generator=gen) + 0.5
    base = torch.rand(64, generator=gen) * 0.5 + 0.25
    weight = torch.stack([base, base.clone(), -base])
    weight[0, 0] = 1.0  # sets row 0's int8 scale: its other entries round coarsely
    weight[1, 0] = 1.0
    weight[1, 1:] = base[1:] + 0.1 / 127 * torch.sign(torch.randn(63, generator=gen))  # similar, rounded otherwise
    for trial in range(2000):  # nudge row 1 until the exact and the int8 orders disagree
        exact = x @ weight.T
        rounded = streamed_gemm.product(x, streamed_gemm.quantize(weight))
        if exact[0, 1] > exact[0, 0] and rounded[0, 0] > rounded[0, 1]:
            return weight, x
        weight[1, 1 + trial % 63] += (1e-4 if exact[0, 1] <= exact[0, 0] else -1e-4)
    raise AssertionError("no near tie found")


def test_a_near_tie_the_int8_weights_alone_get_wrong_is_decided_exactly():
    weight, x = _near_tie()
    exact = _exact(weight)
    assert int(exact(x).argmax()) == 1
    assert int(BoundedHead(weight).logits(x, exact).argmax()) == 1


def test_without_the_bound_the_near_tie_is_decided_wrongly():
    """The test above can fail: with no slack the int8 ranking decides, and picks the wrong token."""
    weight, x = _near_tie()
    head = BoundedHead(weight)
    head.slack[:] = 0.0
    assert int(head.logits(x, _exact(weight)).argmax()) == 0


def test_ties_at_the_maximum_keep_the_lowest_index():
    weight = torch.randn(40, 16, generator=torch.Generator().manual_seed(2))
    weight[7] = weight[30]  # tokens 7 and 30 always tie
    x = weight[30:31] * 3.0  # and are the argmax
    exact = _exact(weight)
    assert int(exact(x).argmax()) == 7
    assert int(BoundedHead(weight).logits(x, exact).argmax()) == 7


def test_too_many_candidates_or_a_non_finite_input_compute_everything_exactly(monkeypatch):
    weight = torch.randn(500, 24, generator=torch.Generator().manual_seed(3))
    head, exact = BoundedHead(weight), _exact(weight)
    x = torch.randn(2, 24)
    monkeypatch.setattr(argmax_head, "MAX_CANDIDATES", 0)
    assert torch.equal(head.logits(x, exact), exact(x))
    monkeypatch.undo()
    x[1, 3] = float("nan")
    got, want = head.logits(x, exact), exact(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_slack_covers_the_int8_rounding_exactly_as_measured():
    weight = torch.randn(100, 50, generator=torch.Generator().manual_seed(4))
    quantized = streamed_gemm.quantize(weight)
    dequantized = quantized.panels.permute(0, 2, 1).reshape(-1, 50)[:100].double() * quantized.scales.double()[:, None]
    error = torch.linalg.vector_norm(dequantized - weight.double(), dim=1)
    slack = argmax_head.slack(weight, quantized.scales)
    assert bool((slack > error).all()) and bool((slack < 1.05 * error + 1e-3).all())


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="finite 2-D float32"):
        BoundedHead(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="finite 2-D float32"):
        BoundedHead(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="finite 2-D float32"):
        BoundedHead(torch.tensor([[1.0, 2.0], [float("nan"), 0.5]]))


def test_the_bounded_head_is_rebuilt_when_the_weight_changes():
    model = build_tiny_model("llama", dtype=torch.float32)
    with packed_linears(model):
        first = bounded_head(model.lm_head)
        assert bounded_head(model.lm_head) is first
        with torch.no_grad():
            model.lm_head.weight.mul_(2.0)
        assert bounded_head(model.lm_head) is not first


def test_the_head_forward_is_installed_only_for_eligible_models_and_removed_after():
    model = build_tiny_model("llama", dtype=torch.float32)
    with packed_linears(model):
        set_default_rows(model, 0)
        set_streamed_rows(model, 16)
        x = torch.randn(1, 3, 32)
        with argmax_logits(model) as on:
            assert on and "forward" in model.lm_head.__dict__
            got = model.lm_head(x)
            big = model.lm_head(torch.randn(1, 20, 32))  # more rows than the streamed kernel's: the own forward
        assert "forward" not in model.lm_head.__dict__
        assert torch.equal(got.argmax(-1), model.lm_head(x).argmax(-1)) and big.shape == (1, 20, 64)
        with argmax_logits(model, enabled=False) as on:
            assert not on
    with argmax_logits(model) as on:  # not packed: nothing to do
        assert not on
    granite_like = build_tiny_model("llama", dtype=torch.float32)
    with packed_linears(granite_like), _renamed(granite_like, "GraniteForCausalLM"), argmax_logits(granite_like) as on:
        assert not on  # scales its logits after the head: not eligible


def test_a_head_held_in_an_exact_block_form_keeps_its_own_exact_product():
    """A head whose weight is GGUF's Q8_0 form expanded (as the default model's is) streams from that form, 1.125
    bytes a weight: the bounded head would save nothing, so its own product runs; held as float32 panels
    (compact weights off), the bounded head does."""
    model = build_tiny_model("llama", dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.copy_(q8_0(model.lm_head.weight))
    with packed_linears(model):
        set_default_rows(model, 0)
        set_streamed_rows(model, 16)
        with argmax_logits(model) as on:
            assert not on and "forward" not in model.lm_head.__dict__
            assert model.lm_head.packed.streamed().kind == "scaled8"
        set_compact_weights(model, False)
        with argmax_logits(model) as on:
            assert on and model.lm_head.packed.streamed().kind == "float32"


class _renamed:
    """Give a model's class another name for the block (the eligibility check reads class names)."""

    def __init__(self, model, name):
        self.cls, self.name = type(model), name

    def __enter__(self):
        self.saved, self.cls.__name__ = self.cls.__name__, self.name

    def __exit__(self, *exc):
        self.cls.__name__ = self.saved


class _Counting:
    """Counts `BoundedHead.logits` calls (to show a generation really used the bounded head)."""

    def __init__(self, monkeypatch):
        self.calls, real = 0, BoundedHead.logits

        def counted(head, x, exact):
            self.calls += 1
            return real(head, x, exact)

        monkeypatch.setattr(BoundedHead, "logits", counted)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma", "phi3", "gpt2"])
@pytest.mark.parametrize("config", [LookaheadConfig(**STREAMED_ONLY),
                                    LookaheadConfig.off().with_overrides(**STREAMED_ONLY)], ids=["speculate", "off"])
def test_greedy_with_the_bounded_head_is_plain_greedy(family, config, monkeypatch):
    model = build_tiny_model(family, dtype=torch.float32, seed=5, layers=3, vocab=256)
    counter = _Counting(monkeypatch)
    for seed in range(3):
        prompt = repetitive_prompt(seed, vocab=256)
        plain = model.generate(prompt, do_sample=False, max_new_tokens=40)
        fast = model.generate(prompt, do_sample=False, max_new_tokens=40, custom_generate=Lookahead(config))
        assert torch.equal(plain, fast)
    assert counter.calls > 0


def test_sampling_processors_and_scores_never_see_bounded_logits(monkeypatch):
    model = build_tiny_model("llama", dtype=torch.float32, seed=5, vocab=256)
    counter = _Counting(monkeypatch)
    prompt = repetitive_prompt(0, vocab=256)
    config = LookaheadConfig(**STREAMED_ONLY)
    model.generate(prompt, do_sample=True, max_new_tokens=12, custom_generate=Lookahead(config))
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    model.generate(prompt, do_sample=False, max_new_tokens=12, custom_generate=Lookahead(config),
                   logits_processor=penalty)
    model.generate(prompt, do_sample=False, max_new_tokens=12, custom_generate=Lookahead(config),
                   return_dict_in_generate=True, output_scores=True)
    model.generate(prompt, do_sample=False, max_new_tokens=12,
                   custom_generate=Lookahead(config.with_overrides(argmax_head=False)))
    assert counter.calls == 0
