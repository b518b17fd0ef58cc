"""A prompt's causal attention on the compiled AVX-512 kernel (`prefill_attention.py`): the attention SDPA computes
(to float32 rounding), causal to the key, taken only where it applies, and greedy generation through it identical
to plain greedy."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt

from lookahead import Lookahead, attention, prefill_attention, streamed_gemm
from lookahead.compat import CACHE_KWARG
from lookahead.compiled_ir import host_features

needs_avx512 = pytest.mark.skipif(
    "+avx512f" not in host_features().split(",") or not streamed_gemm.available(),
    reason="the kernel is written for AVX-512 (and needs the streamed kernels' conditions)")
F = torch.nn.functional


def _qkv(heads: int, kv_heads: int, rows: int, slots: int, size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, rows, size, generator=generator),
            torch.randn(1, kv_heads, slots, size, generator=generator),
            torch.randn(1, kv_heads, slots, size, generator=generator))


def _reference(query, key, value) -> torch.Tensor:
    """[1, T, H, D] causal attention at the last T of S positions, in float64."""
    rows, slots = query.shape[2], key.shape[2]
    visible = torch.ones(rows, slots, dtype=torch.bool).tril(slots - rows)
    return F.scaled_dot_product_attention(query.double(), key.double(), value.double(), attn_mask=visible,
                                          enable_gqa=True).transpose(1, 2)


@needs_avx512
@pytest.mark.parametrize("heads, kv_heads, rows, slots, size", [
    (9, 3, 300, 300, 64),  # the default model's heads, a whole prompt
    (4, 2, 37, 37, 32),  # rows not a multiple of a tile, keys not a multiple of a block
    (4, 4, 5, 21, 16),  # a prompt's tail after cached positions, no grouping
    (8, 2, 2, 2, 128),  # two rows, wide heads
    (2, 1, 100, 130, 64),  # one key head for all
    (6, 3, 33, 70, 16),
])
def test_the_kernel_computes_the_causal_attention(heads, kv_heads, rows, slots, size):
    """Within float32 rounding of the float64 attention: at most twice as far from it as SDPA's own float32 result."""
    query, key, value = _qkv(heads, kv_heads, rows, slots, size)
    exact = _reference(query, key, value)
    got = prefill_attention.causal_attention(query, key, value, size ** -0.5)
    assert got.shape == (1, rows, heads, size) and got.dtype == torch.float32
    visible = torch.ones(rows, slots, dtype=torch.bool).tril(slots - rows)
    sdpa = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, enable_gqa=True).transpose(1, 2)
    sdpa_error = (sdpa.double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 2 * sdpa_error


@needs_avx512
def test_a_row_never_sees_keys_after_its_position():
    """Changing the keys and values from position 40 on leaves the rows before it bit for bit the same; rows at and
    after it change (a mask one key too wide or too narrow fails this)."""
    query, key, value = _qkv(4, 2, 70, 70, 32, seed=3)
    before = prefill_attention.causal_attention(query, key, value, 0.2)
    key[:, :, 40:] += 1.0
    value[:, :, 40:] -= 1.0
    after = prefill_attention.causal_attention(query, key, value, 0.2)
    assert torch.equal(before[:, :40], after[:, :40])
    assert not torch.isclose(before[:, 40:], after[:, 40:]).all(-1).any()


@needs_avx512
def test_prefills_in_several_threads_at_once_compute_what_they_compute_alone():
    """The server prefills concurrent requests in their own threads: each call launches its own parallel tiles; and
    one thread computes what two do."""
    cases = [_qkv(9, 3, 150 + 7 * i, 150 + 7 * i, 64, seed=i) for i in range(6)]
    alone = [prefill_attention.causal_attention(*case, 0.125) for case in cases]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda case: prefill_attention.causal_attention(*case, 0.125), cases * 3))
    assert all(torch.equal(got, alone[i % len(cases)]) for i, got in enumerate(together))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # tiles are computed whole, whichever thread takes them: the same bits
        assert torch.equal(prefill_attention.causal_attention(*cases[0], 0.125), alone[0])
    finally:
        torch.set_num_threads(before)


@needs_avx512
def test_the_kernel_passes_its_own_check_where_the_cpu_has_avx512():
    """`available` (which the backend asks before every prefill) holds here: a kernel that built wrong or computed
    wrong would leave every prefill on SDPA, silently slower, without this test."""
    assert prefill_attention.available()


def test_only_causal_prefills_it_computes_are_taken(monkeypatch):
    monkeypatch.setattr(prefill_attention, "available", lambda: True)
    query, key, _ = _qkv(4, 2, 8, 8, 16)
    assert prefill_attention.eligible(query, key, None, 0.0, {})
    assert prefill_attention.eligible(query, key, None, 0.0, {"sliding_window": None})
    refused = [(query, key, torch.zeros(1, 1, 8, 8), 0.0, {}),  # a mask: verification steps, padding
               (query, torch.randn(1, 2, 12, 16), None, 0.0, {}),  # after cached positions (SDPA: top-left)
               (query, key, None, 0.1, {}),  # dropout
               (query, key, None, 0.0, {"sliding_window": 4}),
               (query, key, None, 0.0, {"output_attentions": True}),
               (query, key, None, 0.0, {"is_causal": False}),
               (query[:, :, :1], key, None, 0.0, {}),  # one row: a decoding step
               (query.double(), key.double(), None, 0.0, {}),
               (query.clone().requires_grad_(), key, None, 0.0, {}),
               (torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8), None, 0.0, {}),  # heads of 8 floats
               (torch.randn(1, 3, 8, 16), key, None, 0.0, {}),  # 3 query heads on 2 key heads
               (query.expand(2, -1, -1, -1), key.expand(2, -1, -1, -1), None, 0.0, {})]  # a batch
    assert not any(prefill_attention.eligible(*case) for case in refused)
    monkeypatch.setattr(prefill_attention, "available", lambda: False)
    assert not prefill_attention.eligible(query, key, None, 0.0, {})


class _Counting:
    """Wraps `prefill_attention.causal_attention`, counting calls."""

    def __init__(self, monkeypatch):
        self.calls, self.original = 0, prefill_attention.causal_attention
        monkeypatch.setattr(prefill_attention, "causal_attention", self)

    def __call__(self, *args):
        self.calls += 1
        return self.original(*args)


def _wide_heads_model(family: str) -> torch.nn.Module:
    """A tiny fp32 model with heads of 16 floats (the kernel's smallest), grouped 2 query heads a key head."""
    return build_tiny_model(family, dtype=torch.float32, layers=3, hidden_size=64, num_attention_heads=4,
                            num_key_value_heads=2)


@needs_avx512
@torch.no_grad()
def test_the_backend_runs_a_prefill_on_the_kernel(monkeypatch):
    """A causal layer's prefill through `lookahead_tree` runs the kernel once per layer and gives SDPA's logits
    to float32 rounding; with the kernel switched off, SDPA's own."""
    model = _wide_heads_model("llama")
    prompt = repetitive_prompt(1, length=40)
    plain = model(prompt).logits
    counting = _Counting(monkeypatch)
    model.set_attn_implementation(attention.register())
    assert torch.allclose(model(prompt).logits, plain, atol=1e-5, rtol=1e-5) and counting.calls == 3
    monkeypatch.setattr(attention, "PREFILL_KERNEL", False)
    assert torch.equal(model(prompt).logits, plain) and counting.calls == 3


@needs_avx512
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_with_prefills_on_the_kernel_is_plain_greedy(family, monkeypatch):
    model = _wide_heads_model(family)
    counting = _Counting(monkeypatch)
    for seed in range(3):
        prompt = repetitive_prompt(seed, length=48)
        plain = model.generate(prompt, do_sample=False, max_new_tokens=40)
        assert torch.equal(model.generate(prompt, do_sample=False, max_new_tokens=40, custom_generate=Lookahead()),
                           plain)
    assert counting.calls >= 3 * 3  # each generation's prefill: one call a layer


@needs_avx512
@torch.no_grad()
def test_a_prompt_after_cached_positions_runs_on_the_kernel_unless_its_mask_is_not_causal(monkeypatch):
    """The rest of a prompt after a reused cache (inside `prompt_after_cache`; outside it, as a verification step,
    SDPA): transformers passes the causal mask, the kernel computes it (SDPA's logits to float32 rounding); a mask
    that hides one more key (a draft tree's) keeps SDPA, bit for bit."""
    from transformers import DynamicCache

    model = _wide_heads_model("llama")
    prompt = repetitive_prompt(2, length=40)
    plain = model(prompt).logits[:, 25:]
    counting = _Counting(monkeypatch)
    model.set_attn_implementation(attention.register())
    cache = DynamicCache()
    model(prompt[:, :25], **{CACHE_KWARG: cache}, use_cache=True)
    assert counting.calls == 3  # the first part: no mask
    outside = model(prompt[:, 25:], **{CACHE_KWARG: cache}, use_cache=True).logits  # not a prompt's rest: SDPA
    assert counting.calls == 3 and torch.allclose(outside, plain, atol=1e-5, rtol=1e-5)
    cache.crop(-15)
    with attention.prompt_after_cache():
        rest = model(prompt[:, 25:], **{CACHE_KWARG: cache}, use_cache=True).logits
    assert counting.calls == 6 and torch.allclose(rest, plain, atol=1e-5, rtol=1e-5)

    visible = torch.ones(15, 40, dtype=torch.bool).tril(25)
    visible[7, 30] = False  # row 7 no longer sees the new row 5: not the causal mask
    mask = torch.zeros(1, 1, 15, 40).masked_fill(~visible, torch.finfo(torch.float32).min)
    positions = torch.arange(25, 40)[None]
    cache.crop(-15)
    with attention.prompt_after_cache():
        tree = model(prompt[:, 25:], attention_mask=mask, position_ids=positions, **{CACHE_KWARG: cache}).logits
    cache.crop(-15)
    model.set_attn_implementation("sdpa")
    expected = model(prompt[:, 25:], attention_mask=mask, position_ids=positions, **{CACHE_KWARG: cache}).logits
    assert counting.calls == 6 and torch.equal(tree, expected)
