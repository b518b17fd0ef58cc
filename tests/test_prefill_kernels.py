"""The compiled element-wise parts of a prefill (`lookahead/prefill_kernels.py`) against PyTorch's, and greedy
generation with long prompts through them against plain greedy."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt

from lookahead import Lookahead, LookaheadConfig, prefill_kernels, streamed_gemm
from lookahead.lean_layers import LeanNorm, _rope

needs_kernels = pytest.mark.skipif(not streamed_gemm.available(), reason="needs the compiled kernels (llvmlite, FMA)")


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _norm(size: int = 96) -> LeanNorm:
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(_randn(size, seed=1))
    module.variance_epsilon = 1e-5
    return LeanNorm(module)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_the_norm_is_pytorchs_within_float32_rounding(scale):
    norm = _norm()
    x = _randn(1, 70, 96, seed=2, scale=scale)
    got, expected = prefill_kernels.rms_norm(x, norm.weight, norm.eps), norm(x)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=2e-6, atol=0)  # only the sum of squares' order differs


def test_the_norm_after_the_residual_adds_it_in_place_exactly():
    norm = _norm()
    x, residual = _randn(1, 70, 96, seed=3), _randn(1, 70, 96, seed=4)
    total = x + residual
    got = prefill_kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(x, total)
    assert torch.allclose(got, norm(total), rtol=2e-6, atol=0)


def test_rope_is_lean_layers_rope_bit_for_bit():
    rows, head_dim = 70, 16
    cos, folded_sin = _randn(rows, head_dim, seed=5), _randn(rows, head_dim, seed=6)
    factors = (cos[None, None], folded_sin[None, None])
    stacked = _randn(1, rows, 7 * head_dim, seed=7)  # q, k and v heads side by side: RoPE on the first 5
    heads = stacked.view(1, rows, -1, head_dim).transpose(1, 2)
    assert torch.equal(prefill_kernels.rope(stacked, 5, cos, folded_sin), _rope(heads[:, :5], factors, head_dim))
    part = stacked[..., 2 * head_dim:4 * head_dim]  # rows of a stride other than their width
    expected = _rope(part.reshape(1, rows, 2, head_dim).transpose(1, 2), factors, head_dim)
    assert torch.equal(prefill_kernels.rope(part, 2, cos, folded_sin), expected)


def test_silu_gating_is_pytorchs_within_float32_rounding():
    gate_up = _randn(1, 70, 2 * 40, seed=8, scale=6.0)
    gate_up[0, 0, :13] = torch.tensor([-200.0, -100.0, -88.8, -87.5, -50.0, -1e-3, 0.0, 1e-30, 3.0, 87.0, 88.8,
                                       100.0, 200.0])
    gate, up = gate_up[..., :40], gate_up[..., 40:]  # halves of one stacked product
    expected = torch.nn.functional.silu(gate) * up
    got = prefill_kernels.silu_times(gate, up)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-35)
    apart = prefill_kernels.silu_times(gate.contiguous(), up.contiguous())
    assert torch.equal(apart, got)


def test_rows_whose_elements_are_not_contiguous_are_refused():
    gate = _randn(1, 70, 40, seed=9)
    with pytest.raises(ValueError, match="contiguous elements"):
        prefill_kernels.silu_times(gate.transpose(1, 2), gate.transpose(1, 2))


def test_it_applies_to_one_long_float32_sequence():
    assert prefill_kernels.applies(torch.zeros(1, prefill_kernels.ROWS, 8))
    assert not prefill_kernels.applies(torch.zeros(1, prefill_kernels.ROWS - 1, 8))  # a decode step's rows
    assert not prefill_kernels.applies(torch.zeros(2, prefill_kernels.ROWS, 8))  # a batch
    assert not prefill_kernels.applies(torch.zeros(1, prefill_kernels.ROWS, 8, dtype=torch.float64))
    assert not prefill_kernels.applies(torch.zeros(1, 8, prefill_kernels.ROWS).transpose(1, 2))


@needs_kernels
@pytest.mark.parametrize("family, extra", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 8})],
                         ids=["llama", "qwen2", "mistral-sliding"])
@pytest.mark.parametrize("config", [LookaheadConfig(), LookaheadConfig.off()], ids=["speculate", "off"])
def test_greedy_with_long_prompts_through_them_is_plain_greedy(family, extra, config, monkeypatch):
    calls = _count_calls(monkeypatch)
    model = build_tiny_model(family, dtype=torch.float32, seed=5, layers=3, **extra)
    for seed in range(2):
        prompt = repetitive_prompt(seed, length=2 * prefill_kernels.ROWS)
        plain = model.generate(prompt, do_sample=False, max_new_tokens=30)
        fast = model.generate(prompt, do_sample=False, max_new_tokens=30, custom_generate=Lookahead(config))
        assert torch.equal(plain, fast), seed
    # 3 layers × 2 prefills; RoPE once a layer on stacked q/k/v, twice on q and k apart (products one by one)
    assert (calls["rms_norm"], calls["add_rms_norm"], calls["silu_times"]) == (6, 6, 6)
    assert calls["rope"] in (6, 12)


@needs_kernels
def test_a_batch_of_long_prompts_through_them_is_plain_batched_generate(monkeypatch):
    """The prompts of a left-padded batch are prefilled one by one (`prefill.py`), each through the compiled passes."""
    calls = _count_calls(monkeypatch)
    model = build_tiny_model("llama", dtype=torch.float32, seed=5, layers=3)
    lengths = (2 * prefill_kernels.ROWS, prefill_kernels.ROWS + 10)
    ids = torch.zeros(2, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, -length:] = repetitive_prompt(row, length=length)[0]
        mask[row, -length:] = 1
    kwargs = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, custom_generate=Lookahead(), **kwargs))
    assert calls["rms_norm"] == calls["silu_times"] == 2 * 3  # 2 prompts × 3 layers


def _count_calls(monkeypatch) -> dict:
    """Count the calls of the compiled passes (still computing them), by name."""
    calls = {name: 0 for name in ("rms_norm", "add_rms_norm", "rope", "silu_times")}
    for name in calls:
        monkeypatch.setattr(prefill_kernels, name, _counted(getattr(prefill_kernels, name), name, calls))
    return calls


def _counted(function, name: str, calls: dict):
    def counted(*args):
        calls[name] += 1
        return function(*args)
    return counted
