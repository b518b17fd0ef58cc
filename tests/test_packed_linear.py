"""Tests for lookahead/packed_linear.py: the same products as `nn.Linear`, swapped in and out cleanly, never
stale, fused siblings right in any call order, and greedy generation through them identical to plain greedy."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList

from lookahead import Lookahead, LookaheadConfig, streamed_gemm
from lookahead.packed_linear import (FusedGroup, FusedMember, PackedLinear, packed_linears, packed_weights,
                                     packing_available, set_default_rows, set_streamed_rows)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
def test_packed_linear_computes_the_linear_product(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    for x in (torch.randn(rows, 48), torch.randn(2, rows, 48)):
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_a_packed_weight_follows_in_place_changes_and_replacements():
    linear = nn.Linear(16, 24, bias=True)
    packed = PackedLinear(linear)
    x = torch.randn(3, 16)
    packed(x)
    with torch.no_grad():
        linear.weight.mul_(2.0)
        linear.bias.add_(1.0)
    torch.testing.assert_close(packed(x), linear(x))
    linear.weight = nn.Parameter(torch.randn(24, 16))
    torch.testing.assert_close(packed(x), linear(x))


def test_fused_siblings_give_each_linear_its_own_output_in_any_call_order():
    torch.manual_seed(0)
    linears = [nn.Linear(32, n, bias=False) for n in (32, 16, 16)]
    group = FusedGroup(linears)
    members = [FusedMember(group, i) for i in range(3)]
    x, y = torch.randn(5, 32), torch.randn(5, 32)
    for order in ([0, 1, 2], [2, 0, 1], [1, 1, 0, 2]):
        for i in order:
            torch.testing.assert_close(members[i](x), linears[i](x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(members[0](x), linears[0](x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(members[1](y), linears[1](y), rtol=1e-5, atol=1e-5)  # another input: recomputed
    x.add_(1.0)  # the same tensor changed in place: recomputed
    torch.testing.assert_close(members[2](x), linears[2](x), rtol=1e-5, atol=1e-5)


def _poison(packed) -> None:
    """Make a `_PackedWeights` hand out a zero weight (so any product taken on it shows)."""
    weight, _ = packed.get()
    packed.weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(weight.shape[0], packed.linears[0].in_features),
                                                            None)


@pytest.mark.parametrize("bias", [False, True])
def test_products_of_few_rows_take_the_default_matmul_and_larger_ones_the_packed_weight(bias):
    torch.manual_seed(3)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    packed.packed.default_rows = 2
    _poison(packed.packed)
    for rows in (1, 2):
        x = torch.randn(rows, 48)
        assert torch.equal(packed(x), linear(x))  # the very call nn.Linear makes: equal, not merely close
        assert torch.equal(packed(x.view(1, rows, 48)), linear(x.view(1, rows, 48)))
    x = torch.randn(3, 48)
    expected = linear.bias.expand(3, 80) if bias else torch.zeros(3, 80)
    assert torch.equal(packed(x), expected)  # 3 rows: the (poisoned) packed weight
    assert torch.equal(packed(torch.randn(2, 2, 48)), (expected[:1] if bias else torch.zeros(1, 80)).expand(2, 2, 80))


def test_fused_siblings_with_the_default_matmul_give_each_linear_its_own_output():
    torch.manual_seed(1)
    linears = [nn.Linear(32, n, bias=True) for n in (32, 16, 16)]
    group = FusedGroup(linears)
    group.packed.default_rows = 1
    _poison(group.packed)
    members = [FusedMember(group, i) for i in range(3)]
    x = torch.randn(1, 1, 32)
    for i in (2, 0, 1):
        assert torch.equal(members[i](x), linears[i](x))


needs_streamed = pytest.mark.skipif(not streamed_gemm.available(), reason="streamed kernel not built here")


@needs_streamed
@pytest.mark.parametrize("bias", [False, True])
def test_each_row_count_takes_its_kernel(bias):
    """1 row: the default matmul; 2–3 rows: the streamed kernel (its panels poisoned with ones); 4 rows: the
    default matmul again, as the streamed kernel is in use (the oneDNN weight, poisoned with zeros, is not read);
    without streamed rows, 4 rows: the oneDNN weight."""
    torch.manual_seed(4)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    packed.packed.default_rows, packed.packed.streamed_rows = 1, 3
    _poison(packed.packed)
    packed.packed.streamed()
    packed.packed.panels = streamed_gemm.pack(torch.ones(80, 48), linear.bias)
    x = torch.randn(1, 48)
    assert torch.equal(packed(x), linear(x))
    for rows in (2, 3):
        x = torch.randn(1, rows, 48)
        expected = x.sum(-1, keepdim=True).expand(1, rows, 80) + (linear.bias if bias else 0)
        torch.testing.assert_close(packed(x), expected)
    x = torch.randn(4, 48)
    assert torch.equal(packed(x), linear(x))
    packed.packed.streamed_rows = 0
    expected = linear.bias.expand(4, 80) if bias else torch.zeros(4, 80)
    assert torch.equal(packed(x), expected)


@needs_streamed
def test_with_the_streamed_kernel_no_onednn_copy_of_the_weights_is_made():
    torch.manual_seed(6)
    linears = [nn.Linear(32, n) for n in (48, 16)]
    group = FusedGroup(linears)
    group.packed.streamed_rows = 4
    members = [FusedMember(group, i) for i in range(2)]
    for rows in (3, 40):  # a verification-sized product and a prefill-sized one
        x = torch.randn(1, rows, 32)
        for i in (0, 1):
            torch.testing.assert_close(members[i](x), linears[i](x), rtol=1e-5, atol=1e-5)
    assert group.packed.weight is None and group.packed.panels is not None
    group.packed.streamed_rows = 0
    members[0](torch.randn(1, 40, 32))
    assert group.packed.weight is not None  # without the streamed kernel, large products are oneDNN's


@needs_streamed
@pytest.mark.parametrize("bias", [False, True])
def test_products_above_the_streamed_rows_run_unpacked_onednn_when_chosen(monkeypatch, bias):
    """A prefill-sized product of fused siblings on oneDNN with the layers' own weights: each linear's output, the
    default matmul never called and no oneDNN copy of the weights made; a bad kernel name is refused."""
    import lookahead.packed_linear as packed_linear

    torch.manual_seed(7)
    linears = [nn.Linear(32, n, bias=bias) for n in (48, 16)]
    group = FusedGroup(linears)
    group.packed.streamed_rows, group.packed.large = 4, "onednn"
    members = [FusedMember(group, i) for i in range(2)]
    x = torch.randn(1, 40, 32)
    expected = [linear(x) for linear in linears]
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *args: pytest.fail("default matmul called"))
    for i in (0, 1):
        torch.testing.assert_close(members[i](x), expected[i], rtol=1e-5, atol=1e-5)
    assert group.packed.weight is None
    model = nn.Sequential(nn.Linear(8, 8))
    with packed_linears(model):
        packed_linear.set_large_kernel(model, "onednn")
        assert packed_weights(model)[0].large == "onednn"
        with pytest.raises(ValueError, match="large-product kernel"):
            packed_linear.set_large_kernel(model, "mkl")
    assert model._lookahead_large_kernel == "default"  # the swap resets it


@needs_streamed
def test_products_above_the_streamed_rows_stay_on_the_streamed_kernel_when_chosen(monkeypatch):
    """With the large kernel "streamed" a prefill-sized product of fused siblings runs the streamed kernel like a
    step's: the stacked product split, neither the default matmul nor oneDNN called."""
    import lookahead.packed_linear as packed_linear

    torch.manual_seed(8)
    linears = [nn.Linear(32, n) for n in (48, 16)]
    group = FusedGroup(linears)
    group.packed.streamed_rows, group.packed.large = 4, "streamed"
    members = [FusedMember(group, i) for i in range(2)]
    x = torch.randn(1, 40, 32)
    expected = [linear(x) for linear in linears]
    calls = []
    real = packed_linear.streamed_product
    monkeypatch.setattr(packed_linear, "streamed_product", lambda *args: calls.append(1) or real(*args))
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *args: pytest.fail("default matmul called"))
    monkeypatch.setattr(packed_linear, "_onednn_linear", lambda *args: pytest.fail("oneDNN called"))
    for i in (0, 1):
        torch.testing.assert_close(members[i](x), expected[i], rtol=1e-5, atol=1e-5)
    assert calls and group.packed.weight is None


@needs_streamed
def test_the_streamed_layout_follows_in_place_changes_and_fused_siblings_get_their_slices():
    torch.manual_seed(5)
    linears = [nn.Linear(32, n, bias=True) for n in (32, 16, 16)]
    group = FusedGroup(linears)
    group.packed.streamed_rows = 8
    members = [FusedMember(group, i) for i in range(3)]
    x = torch.randn(1, 5, 32)
    for i in (1, 2, 0):
        torch.testing.assert_close(members[i](x), linears[i](x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        linears[1].weight.mul_(-3.0)
    x = torch.randn(1, 5, 32)
    for i in (0, 1, 2):
        torch.testing.assert_close(members[i](x), linears[i](x), rtol=1e-5, atol=1e-5)


def test_set_streamed_rows_reaches_every_packed_weight_and_refuses_what_cannot_run(monkeypatch):
    model = build_tiny_model("llama", dtype=torch.float32)
    with packed_linears(model):
        weights = packed_weights(model)
        with pytest.raises(ValueError, match="streamed-kernel rows"):
            set_streamed_rows(model, -1)
        if streamed_gemm.available():
            set_streamed_rows(model, 16)
            assert {w.streamed_rows for w in weights} == {16} and model._lookahead_streamed_rows == 16
        monkeypatch.setattr(streamed_gemm, "available", lambda: False)
        with pytest.raises(ValueError, match="not available on this machine"):
            set_streamed_rows(model, 4)
        set_streamed_rows(model, 0)  # turning it off always works
    assert {w.streamed_rows for w in weights} == {0} and model._lookahead_streamed_rows == 0


def test_set_default_rows_reaches_every_packed_weight_and_the_swap_resets_it():
    model = build_tiny_model("llama", dtype=torch.float32)
    with packed_linears(model):
        weights = packed_weights(model)
        assert len(weights) == 4 * 2 + 1  # q/k/v, o, gate/up, down in each of 2 layers + the LM head
        set_default_rows(model, 3)
        assert {w.default_rows for w in weights} == {3} and model._lookahead_default_rows == 3
        with pytest.raises(ValueError, match="default-matmul rows"):
            set_default_rows(model, -1)
    assert {w.default_rows for w in weights} == {0} and model._lookahead_default_rows == 0


def test_the_swap_is_undone_and_leaves_parameters_alone():
    model = build_tiny_model("llama", dtype=torch.float32)
    before = {name: module for name, module in model.named_modules()}
    keys = list(model.state_dict())
    assert packing_available(model)
    with packed_linears(model) as swapped:
        assert swapped == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + the LM head
        assert isinstance(model.model.layers[0].self_attn.q_proj, FusedMember)
        assert isinstance(model.lm_head, PackedLinear)
        assert list(model.state_dict()) == keys
        with packed_linears(model) as nested:
            assert nested == 0
    assert {name: module for name, module in model.named_modules()} == before
    with pytest.raises(RuntimeError), packed_linears(model):
        raise RuntimeError("boom")
    assert model.lm_head is before["lm_head"]  # restored on error too


def test_nothing_is_packed_for_fp64_models_or_when_disabled():
    model = build_tiny_model("llama", dtype=torch.float64)
    assert not packing_available(model)
    with packed_linears(model) as swapped:
        assert swapped == 0
    with packed_linears(build_tiny_model("llama", dtype=torch.float32), enabled=False) as swapped:
        assert swapped == 0


class _LinearTypes(LogitsProcessor):
    """Records the type of the model's LM head at every decoding step."""

    def __init__(self, model):
        self.model, self.seen = model, set()

    def __call__(self, input_ids, scores):
        self.seen.add(type(self.model.lm_head).__name__)
        return scores


STREAMED_ONLY = dict(default_matmul_rows=0, streamed_matmul_rows=16)  # every step's products on the streamed kernel
ONEDNN = dict(default_matmul_rows=2, streamed_matmul_rows=0)  # no streamed kernel: products of 3+ rows on oneDNN


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma", "phi3"])
@pytest.mark.parametrize("config", [
    LookaheadConfig(), LookaheadConfig.off(),
    pytest.param(LookaheadConfig(**STREAMED_ONLY), marks=needs_streamed),
    pytest.param(LookaheadConfig.off().with_overrides(**STREAMED_ONLY), marks=needs_streamed),
    LookaheadConfig(**ONEDNN)],
    ids=["speculate", "off", "speculate-streamed", "off-streamed", "speculate-onednn"])
def test_greedy_through_packed_linears_is_plain_greedy(family, config):
    model = build_tiny_model(family, dtype=torch.float32, seed=3, layers=3)
    for seed in range(2):
        prompt = repetitive_prompt(seed)
        plain = model.generate(prompt, do_sample=False, max_new_tokens=40)
        spy = _LinearTypes(model)
        decoder = Lookahead(config)
        fast = model.generate(prompt, do_sample=False, max_new_tokens=40, custom_generate=decoder,
                              logits_processor=LogitsProcessorList([spy]))
        assert torch.equal(plain, fast)
        assert spy.seen == {"PackedLinear"}  # the generation really ran on packed weights
    assert type(model.lm_head) is nn.Linear
