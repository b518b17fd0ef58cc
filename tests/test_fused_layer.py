"""The fused decoder-layer step (`fused_layer.py`, `fused_kernels.py`): the lean forward's numbers to rounding, the
cache filled alike, calls it does not compute left to the lean forward, and greedy generation through it identical
to plain greedy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import FUSED_ARCHITECTURES, fused_test_model, repetitive_prompt, three_steps

from lookahead import (Lookahead, LookaheadConfig, attention_kernel, decode_attention, fused_kernels, fused_layer,
                       fused_stack, hf, streamed_gemm)
from lookahead.attention import tree_attention
from lookahead.lean_layers import lean_layers
from lookahead.packed_linear import packed_linears
from lookahead.row_kernels import RowKernels, apply_row_kernels

pytestmark = pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and streamed_gemm.available()),
                                reason="needs oneDNN and the streamed kernel (a CPU with FMA)")


def _model(name: str, **extra):
    return fused_test_model(name, 5, **extra)


class _Calls:
    """Counts fused layer steps: calls of `decoder_layer`, or of `layer_output` (the end of a step attending with
    SDPA), and the layers of each `decoder_stack` call (a step of every layer at once, `fused_stack`)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("decoder_layer", "layer_output"):
            monkeypatch.setattr(fused_layer, name, self._counted(getattr(fused_layer, name)))
        monkeypatch.setattr(fused_stack, "decoder_stack", self._counted(fused_stack.decoder_stack, stacked=True))

    def _counted(self, real, stacked: bool = False):
        def counted(*args):
            self.count += args[4].shape[0] if stacked else 1  # panels [layers, 4]
            return real(*args)

        return counted


def _steps(model, prompt: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`three_steps`' logits, and the cache's keys and values after them."""
    logits, cache = three_steps(model, prompt)
    return logits, [state for layer in cache.layers for state in (layer.keys, layer.values)]


def _run(model, prompt, kernels: RowKernels, fused: bool):
    with torch.no_grad(), packed_linears(model), tree_attention(model), lean_layers(model, fused=fused):
        apply_row_kernels(model, kernels)
        return _steps(model, prompt)


@pytest.mark.parametrize("attention", ["grouped", "compiled", "numba", "sdpa"])
@pytest.mark.parametrize("name", list(FUSED_ARCHITECTURES))
def test_fused_steps_compute_the_lean_forward_to_rounding(name, attention, monkeypatch):
    monkeypatch.setattr(fused_layer, "GROUPED", attention == "grouped")  # decode_attention's kernel where it runs
    if attention in ("numba", "sdpa"):  # numba's attention loops (heads of any size)
        monkeypatch.setattr(attention_kernel, "supports", lambda head_dim: False)
    if attention == "sdpa":  # with numba's loops, every step of several rows attends with SDPA between two calls
        monkeypatch.setattr(fused_layer, "COMPILED_ATTENTION_MAX", 0)
    model = _model(name)
    prompt = repetitive_prompt(1, length=30)
    kernels = RowKernels(0, 8)  # one-row and 6-row steps on the streamed kernel; the prefill is not
    lean_logits, lean_cache = _run(model, prompt, kernels, fused=False)
    calls = _Calls(monkeypatch)
    fused_logits, fused_cache = _run(model, prompt, kernels, fused=True)
    assert calls.count == 2 * 3  # the one-row and the tree step, in each of the 3 layers
    assert torch.equal(lean_logits[0], fused_logits[0])  # the prefill ran the lean forward
    for lean, fused in zip(lean_logits[1:] + lean_cache, fused_logits[1:] + fused_cache, strict=True):
        assert lean.shape == fused.shape
        torch.testing.assert_close(fused, lean, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("case", ["rows-beyond-the-streamed-kernel", "sliding-window", "fused-off"])
def test_calls_the_fused_step_does_not_compute_run_the_lean_forward(case, monkeypatch):
    model = _model("mistral", sliding_window=8) if case == "sliding-window" else _model("llama")
    kernels = RowKernels(0, 4 if case == "rows-beyond-the-streamed-kernel" else 8)
    prompt = repetitive_prompt(1, length=30)
    calls = _Calls(monkeypatch)
    _run(model, prompt, kernels, fused=case != "fused-off")
    assert calls.count == (3 if case == "rows-beyond-the-streamed-kernel" else 0)  # there: the one-row step only


def test_rows_on_the_default_matmul_are_not_fused(monkeypatch):
    model = _model("llama")
    calls = _Calls(monkeypatch)
    _run(model, repetitive_prompt(1, length=30), RowKernels(1, 8), fused=True)
    assert calls.count == 3  # the tree step only: its one-row step ran PyTorch's default matmul


def _attention_inputs(rows: int, cached: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    length = cached + rows
    queries = torch.randn(rows, 6, 16, generator=gen)
    keys, values = (torch.randn(2, length + 3, 16, generator=gen) * 2 for _ in range(2))
    mask = torch.zeros(rows, length)
    blocked = torch.rand(rows, rows, generator=gen) < 0.5
    blocked.fill_diagonal_(False)
    mask[:, cached:][blocked] = torch.finfo(torch.float32).min
    return queries, keys, values, mask


def _reference(queries, keys, values, mask, length):
    """float64 attention (grouped-query: query heads 3h..3h+2 read key head h)."""
    q = queries.double().transpose(0, 1)  # [heads, rows, D]
    k, v = (x[:, :length].double().repeat_interleave(3, dim=0) for x in (keys, values))
    scores = q @ k.transpose(1, 2) * 0.25 + mask.double()
    return (scores.softmax(-1) @ v).transpose(0, 1)


def _loops(kind: str) -> np.ndarray:
    """`attend`'s `kernels` argument for heads of 16 floats: `attention_kernel`'s compiled loops, `decode_attention`'s
    kernel on vectors of 16 or 8 floats (skips the test where it does not run), or none (numba's loops)."""
    if kind.startswith("grouped"):
        lanes = int(kind[len("grouped"):])
        if not decode_attention.available(lanes):
            pytest.skip(f"decode_attention's {lanes}-float kernel does not run on this CPU")
        return np.array([decode_attention.address(16, lanes)], np.int64)
    return np.array(attention_kernel.attention_addresses(16), np.int64) if kind == "compiled" else np.empty(0, np.int64)


@pytest.mark.parametrize("loops", ["grouped16", "grouped8", "compiled", "numba"])
@pytest.mark.parametrize("rows,cached", [(1, 0), (1, 37), (5, 40), (13, 3)])
def test_attention_matches_float64_and_masked_keys_weigh_exactly_nothing(rows, cached, loops):
    queries, keys, values, mask = _attention_inputs(rows, cached)
    length = cached + rows
    out = np.empty((rows, 6, 16), np.float32)
    fused_kernels.attend(queries.numpy(), keys.numpy(), values.numpy(), length, mask.numpy(), np.float32(0.25), 2,
                         _loops(loops), out)
    torch.testing.assert_close(torch.from_numpy(out).double(), _reference(queries, keys, values, mask, length),
                               rtol=1e-5, atol=1e-6)
    poisoned = values.clone()  # huge values where a row's mask blocks: a weight of exactly 0 leaves them out
    visible = mask[:, cached:] == 0
    if rows > 1 and not visible.all():
        row, col = (~visible).nonzero()[0].tolist()
        poisoned[:, cached + col] = 1e30
        again = np.empty_like(out)
        fused_kernels.attend(queries.numpy(), keys.numpy(), poisoned.numpy(), length, mask.numpy(), np.float32(0.25),
                             2, _loops(loops), again)
        assert np.array_equal(again[row], out[row])


@pytest.mark.parametrize("loops", ["grouped16", "grouped8", "compiled", "numba"])
@pytest.mark.parametrize("rows,cached,padding", [(1, 30, 11), (4, 25, 7), (3, 12, 1)])
def test_a_padded_entry_attends_as_it_does_without_its_padding(rows, cached, padding, loops):
    """Slots every row's mask hides at the front (a left-padded batch entry's padding) are skipped: the output is,
    bit for bit, that of the same rows over the keys without those slots, whatever the padding slots hold (NaN
    here: read at all, they would poison every row)."""
    queries, keys, values, mask = _attention_inputs(rows, cached + padding, seed=5)
    low = torch.finfo(torch.float32).min
    mask[:, :padding] = low
    if rows > 1:
        mask[0, padding] = low  # one row hides one more slot: the lead is what every row hides
    keys[:, :padding], values[:, :padding] = float("nan"), float("nan")
    length = cached + padding + rows
    assert fused_kernels.hidden_lead(mask.numpy(), 0, rows) == padding
    padded, trimmed = (np.empty((rows, 6, 16), np.float32) for _ in range(2))
    fused_kernels.attend_after(queries.numpy(), keys.numpy(), values.numpy(), padding, length, mask.numpy(),
                               np.float32(0.25), 2, _loops(loops), padded)
    fused_kernels.attend(queries.numpy(), keys[:, padding:].contiguous().numpy(),
                         values[:, padding:].contiguous().numpy(), length - padding,
                         mask[:, padding:].contiguous().numpy(), np.float32(0.25), 2, _loops(loops), trimmed)
    assert np.array_equal(padded, trimmed) and not np.isnan(padded).any()


def test_the_hidden_lead_is_what_every_row_hides_at_the_front():
    low = np.float32(torch.finfo(torch.float32).min)
    mask = np.zeros((3, 8), np.float32)
    mask[0, :5] = low
    mask[1, :3] = low
    mask[2, :6] = low
    assert fused_kernels.hidden_lead(mask, 0, 3) == 3
    assert fused_kernels.hidden_lead(mask, 0, 1) == 5 and fused_kernels.hidden_lead(mask, 2, 3) == 6
    mask[:, 3] = -1e20  # a large but not hiding value (e.g. a logit bias) ends the lead
    assert fused_kernels.hidden_lead(mask, 0, 3) == 3 and fused_kernels.hidden_lead(mask, 0, 1) == 3
    assert fused_kernels.hidden_lead(np.full((2, 4), low), 0, 2) == 3  # never every slot
    assert fused_kernels.hidden_lead(np.empty((0, 0), np.float32), 0, 1) == 0  # the "none" mask


@pytest.mark.parametrize("loops", ["grouped16", "grouped8", "compiled", "numba"])
def test_attention_without_a_mask_sees_every_slot(loops):
    queries, keys, values, _ = _attention_inputs(1, 20, seed=3)
    out = np.empty((1, 6, 16), np.float32)
    fused_kernels.attend(queries.numpy(), keys.numpy(), values.numpy(), 21, np.empty((0, 0), np.float32),
                         np.float32(0.25), 1, _loops(loops), out)
    torch.testing.assert_close(torch.from_numpy(out).double(),
                               _reference(queries, keys, values, torch.zeros(1, 21), 21), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-odd-width", "llama-heads16", "qwen2-heads16"])
@pytest.mark.parametrize("config", [LookaheadConfig(), LookaheadConfig.off()], ids=["speculate", "off"])
@pytest.mark.parametrize("lanes", [16, 8, 0], ids=["grouped16", "grouped8", "attention-loops"])
def test_greedy_through_fused_layers_is_plain_greedy(name, config, lanes, monkeypatch):
    if lanes and not decode_attention.available(lanes):
        pytest.skip(f"decode_attention's {lanes}-float kernel does not run on this CPU")
    monkeypatch.setattr(fused_layer, "GROUPED", lanes > 0)
    monkeypatch.setattr(decode_attention, "host_lanes", lambda: lanes)
    monkeypatch.setattr(hf, "row_kernels_for", lambda model, refresh=False, quiet=False: RowKernels(0, 64))
    chosen, real = [], fused_layer.attention_loops
    monkeypatch.setattr(fused_layer, "attention_loops", lambda head_dim: chosen.append(real(head_dim)) or chosen[-1])
    model = _model(name)
    calls = _Calls(monkeypatch)
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        plain = model.generate(prompt, do_sample=False, max_new_tokens=40)
        fast = model.generate(prompt, do_sample=False, max_new_tokens=40, custom_generate=Lookahead(config))
        assert torch.equal(plain, fast)
    assert calls.count > 0  # every step after the prefill ran the fused layers
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    kernel = lanes and decode_attention.supports(head_dim, lanes)
    expected = 1 if kernel else 2  # the kernel's address, or the two loops'
    assert chosen and {len(loops) for loops in chosen} == {expected}


def test_numpy_views_made_once_per_forward_see_in_place_changes_and_copy_what_is_not_contiguous():
    mask = torch.zeros(1, 1, 3, 5)
    plane = fused_layer._plane(mask)
    assert fused_layer._plane(mask) is plane  # the next layer of the forward: the same view
    mask[0, 0, 1, 2] = -7.0  # changed in place between calls: the remembered view shows it
    assert fused_layer._plane(mask)[1, 2] == -7.0
    strided = torch.zeros(1, 1, 5, 3).transpose(-1, -2)  # a plane that is not contiguous: a fresh copy each call
    first = fused_layer._plane(strided)
    strided[0, 0, 0, 0] = 4.0
    assert fused_layer._plane(strided)[0, 0] == 4.0 and first[0, 0] == 0.0


def test_a_layer_reads_the_previous_layers_output_view_and_converts_any_other_input():
    hidden = torch.randn(1, 2, 4)
    out, rows = fused_layer._new_output(hidden)
    assert out.shape == hidden.shape and out.dtype == torch.float32
    assert fused_layer._rows(out) is rows  # the next layer's input is this output
    other = torch.randn(1, 2, 4)
    np.testing.assert_array_equal(fused_layer._rows(other), other[0].numpy())
