"""The AMX kernel (`amx_kernel.py`): its record layout and prepared inputs, products float32-accurate against float64
for any row count and shape, each row's sums independent of the rows and threads computing it, its use for 4-bit
weights where the CPU has AMX, and greedy generation through it identical to plain greedy (speculating and with
speculation off, fused and per-layer steps). The kernel's tests run only on a CPU with AMX."""

from __future__ import annotations

import ctypes

import pytest
import torch
from test_affine_weights import _affine_model
from tiny_models import assert_plain_greedy, repetitive_prompt

from lookahead import Lookahead, LookaheadConfig, affine_weights, amx_kernel, hf, streamed_gemm
from lookahead.packed_linear import packed_weights
from lookahead.row_kernels import RowKernels
from lookahead.warmup_model import q4_1

needs_amx = pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and streamed_gemm.available()
                                    and amx_kernel.available()), reason="needs a CPU with AMX and AVX-512")


def block_weight(form, n: int, k: int, seed: int) -> torch.Tensor:
    """A random float32 weight [n, k] rounded to a GGUF block form (`warmup_model.q4_1`, `q8_0`)."""
    return form(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))


def _q4_1(n: int, k: int, seed: int) -> torch.Tensor:
    """A Q4_1-style float32 weight [n, k] (float16 scales and offsets, every weight fma(q, d, m))."""
    return block_weight(q4_1, n, k, seed)


def test_records_hold_each_weights_code_scale_and_offset_where_the_kernel_reads_them():
    weight = _q4_1(21, 128, 0)
    scales, offsets, codes = affine_weights.affine_form(weight)
    records = amx_kernel.records(scales, offsets, codes)
    assert records.shape == (2, 4, amx_kernel.RECORD) and records.dtype == torch.uint8
    tail = records.untyped_storage().nbytes() - records.numel()
    assert tail == (amx_kernel.AHEAD + 1) * amx_kernel.RECORD  # zero records the kernel may widen past the end
    halves = records[:, :, :64].contiguous().view(torch.int16).view(2, 4, 16, 2)  # panel, block, column, (d, m)
    words = records[:, :, 64:].contiguous().view(torch.int16).int() & 0xFFFF
    words = words.view(2, 4, 4, 16, 2)  # panel, block, vector j, column, pair
    for column in range(21):
        panel, n = divmod(column, 16)
        for block in range(4):
            assert halves[panel, block, n, 0].view(torch.float16).item() == scales[column, block].item()
            assert halves[panel, block, n, 1].view(torch.float16).item() == offsets[column, block].item()
            for j in range(4):
                for s in range(4):
                    step = 32 * block + 2 * (4 * j + s)
                    got = (words[panel, block, j, n] >> (4 * s)) & 15
                    assert torch.equal(got, codes[column, step:step + 2].int())
    assert not records[1, :, :64].view(torch.int32)[:, 5:].any()  # padding columns: d = m = 0


def test_it_fits_whole_pairs_of_blocks_and_sizes_its_scratch():
    assert amx_kernel.fits(64) and amx_kernel.fits(576) and not amx_kernel.fits(96) and not amx_kernel.fits(0)
    for rows in (2, 16, 17, 40):
        for k in (64, 576, 1536):
            assert amx_kernel.scratch_floats(rows, k) <= streamed_gemm.product_scratch(rows, k)
    assert streamed_gemm.scratch_floats("affine4h", 3, 64) == 3 * 64


@needs_amx
@pytest.mark.parametrize("rows", [2, 5, 16, 17, 40])
def test_prepared_pieces_sum_to_each_input_and_blocks_sum_them(rows):
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) * 100
    scratch = torch.zeros(amx_kernel.scratch_floats(rows, 128))
    transpose = ctypes.CFUNCTYPE(None, *[ctypes.c_int64] * 4)(amx_kernel.addresses()[1])
    transpose(x.data_ptr(), scratch.data_ptr(), rows, 128)
    at = (-scratch.data_ptr()) % 64
    raw = scratch.view(torch.uint8)[at:]
    first = 0
    while first < rows:
        size = min(amx_kernel.GROUP, rows - first)
        pieces_bytes = 5 * amx_kernel.PIECES * size * 64
        pieces = raw[:pieces_bytes].view(torch.bfloat16).view(5, amx_kernel.PIECES, size, 32)
        sums = raw[pieces_bytes:pieces_bytes + 4 * size * 4].view(torch.float32).view(4, size)
        group = x[first:first + size]
        assert torch.equal(pieces[:4].float().sum(1).permute(1, 0, 2).reshape(size, 128), group)
        assert not pieces[4].float().any()  # the zero block the kernel reads past the last
        torch.testing.assert_close(sums, group.reshape(size, 4, 32).sum(-1).t(), rtol=1e-5, atol=1e-3)
        raw, first = raw[amx_kernel._region_bytes(size, 128):], first + size


@needs_amx
@pytest.mark.parametrize("n, k", [(40, 128), (48, 64), (96, 576)])
def test_products_are_float32_accurate_for_any_row_count(n, k):
    weight = _q4_1(n, k, n)
    bias = torch.randn(n)
    packed = affine_weights.pack_stacked([weight[:7], weight[7:]], bias)
    assert packed.kind == "amx4" and packed.in_features == k and packed.out_features == n
    exact_weight = weight.double().t()
    for rows in (1, 2, 3, 8, 16, 17, 33):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        exact = x.double() @ exact_weight + bias.double()
        got = streamed_gemm.product(x, packed)
        assert got.shape == (rows, n)
        assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < 2e-6, rows


@needs_amx
def test_each_rows_sums_do_not_depend_on_the_rows_or_threads_computing_it():
    assert_rows_and_threads_do_not_matter(affine_weights.pack_stacked([_q4_1(80, 192, 3)]))


def assert_rows_and_threads_do_not_matter(packed) -> None:
    """Each of 35 rows' product with `packed` is the same bits alone, among the first few rows, among all and on
    one thread; so is each of 100 rows' (a prompt's: prepared by all the threads), also when one thread prepares
    them all."""
    x = torch.randn(100, packed.in_features, generator=torch.Generator().manual_seed(4))
    together = streamed_gemm.product(x[:35], packed)
    for row in range(35):
        assert torch.equal(streamed_gemm.product(x[row:row + 1], packed)[0], together[row])
    for count in (2, 4, 5, 9):
        assert torch.equal(streamed_gemm.product(x[:count], packed), together[:count])
    assert 100 > streamed_gemm.PREPARED_APART * amx_kernel.GROUP
    many = streamed_gemm.product(x, packed)
    assert torch.equal(many[:35], together)
    for row in (64, 80, 99):
        assert torch.equal(streamed_gemm.product(x[row:row + 1], packed)[0], many[row])
    threads, apart = torch.get_num_threads(), streamed_gemm.PREPARED_APART
    try:
        torch.set_num_threads(1)
        assert torch.equal(streamed_gemm.product(x[:35], packed), together)
        torch.set_num_threads(threads)
        streamed_gemm.PREPARED_APART = len(x)  # one thread prepares every row before the threads start
        assert torch.equal(streamed_gemm.product(x, packed), many)
    finally:
        torch.set_num_threads(threads)
        streamed_gemm.PREPARED_APART = apart


def test_products_of_the_streamed_kinds_share_one_prepare_call():
    """A fused layer runs its four products with one prepare call: the streamed kinds share `transpose`, so a layer
    mixing 4-bit and 8-bit block forms still fuses; the AMX kernel's records need their own."""
    kinds = ("float32", "affine4", "affine4h", "scaled8") if streamed_gemm.vector_width() == 16 else (
        "float32", "affine4", "scaled8")
    assert len({streamed_gemm.prepare_address(kind) for kind in kinds}) == 1
    if amx_kernel.available():
        assert streamed_gemm.prepare_address("amx4") != streamed_gemm.prepare_address("affine4")


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and streamed_gemm.available()),
                    reason="needs oneDNN and the streamed kernel (a CPU with FMA)")
@pytest.mark.parametrize("amx", [False, True], ids=["streamed", "amx"])
def test_a_stack_mixing_4_bit_and_8_bit_layers_runs_fused(amx, monkeypatch):
    """The down products in Q8_0 form ("scaled8"), the others in Q4_1 form: the whole stack still runs as one
    compiled call when they share the prepare call (the streamed kernel's kinds); with the AMX kernels' records
    ("amx4" beside "amx8", each kernel preparing its rows its own way) the layers run step by step instead. Greedy
    stays plain greedy either way."""
    from lookahead import fused_stack
    from lookahead.warmup_model import q8_0

    if amx and not amx_kernel.available():
        pytest.skip("needs a CPU with AMX and AVX-512")
    monkeypatch.setattr(amx_kernel, "available", lambda: amx)
    monkeypatch.setattr(hf, "row_kernels_for", lambda model, refresh=False, quiet=False: RowKernels(0, 64))
    model = _affine_model("llama", hidden_size=64, intermediate_size=128)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.copy_(q8_0(layer.mlp.down_proj.weight))
    calls = []
    real = fused_stack.decoder_stack
    monkeypatch.setattr(fused_stack, "decoder_stack", lambda *args: calls.append(1) or real(*args))
    assert_plain_greedy(model, Lookahead(LookaheadConfig(amx_kernel=amx)), seeds=[0])
    kinds = {packed.panels.kind for packed in packed_weights(model) if packed.panels is not None}
    assert ("amx8" if amx else "scaled8") in kinds and ("amx4" in kinds) == amx
    assert bool(calls) != amx


@needs_amx
def test_weights_it_does_not_fit_keep_the_streamed_kernels_form():
    assert affine_weights.pack_stacked([_q4_1(16, 96, 0)]).kind == "affine4h"  # K = 3 blocks, not whole pairs
    assert affine_weights.pack_stacked([_q4_1(16, 64, 0)], amx=False).kind == "affine4h"
    assert affine_weights.pack_stacked([torch.randn(16, 64)]).kind == "float32"


@needs_amx
@pytest.mark.parametrize("family, extra", [("llama", {}), ("qwen2", {}), ("llama", {"intermediate_size": 96})],
                         ids=["llama", "qwen2", "llama-mixed-kernels"])
@pytest.mark.parametrize("config", [LookaheadConfig(), LookaheadConfig.off()], ids=["speculate", "off"])
def test_greedy_on_the_amx_kernel_is_plain_greedy(family, extra, config, monkeypatch):
    """Greedy through the AMX kernel equals plain greedy; with an MLP width of 96 the down products keep the
    streamed kernel's form, so those layers run step by step instead of fused (their products prepare rows
    differently)."""
    monkeypatch.setattr(hf, "row_kernels_for", lambda model, refresh=False, quiet=False: RowKernels(0, 64))
    model = _affine_model(family, **{"hidden_size": 64, "intermediate_size": 128, **extra})
    assert_plain_greedy(model, Lookahead(config))
    built = [packed.panels.kind for packed in packed_weights(model) if packed.panels is not None]
    assert built.count("amx4") == (3 * 3 if extra else 3 * 4)
    assert model._lookahead_compact_weights == "amx"


@needs_amx
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_with_long_prompts_prefilled_on_the_amx_kernel_is_plain_greedy(family, monkeypatch):
    """A prompt of several groups of rows, every product of it on the AMX kernel (the large kernel "streamed"),
    its rows prepared by all the threads, and its norms, RoPE and SiLU on `prefill_kernels`."""
    monkeypatch.setattr(hf, "row_kernels_for", lambda model, refresh=False, quiet=False: RowKernels(0, 64, "streamed"))
    prepared = []
    launch = streamed_gemm._launch_groups
    monkeypatch.setattr(streamed_gemm, "_launch_groups", lambda *args: prepared.append(args[2]) or launch(*args))
    model = _affine_model(family, hidden_size=64, intermediate_size=128)
    for seed in range(2):
        prompt = repetitive_prompt(seed, length=120)
        plain = model.generate(prompt, do_sample=False, max_new_tokens=30)
        fast = model.generate(prompt, do_sample=False, max_new_tokens=30, custom_generate=Lookahead())
        assert torch.equal(plain, fast), seed
    assert prepared and set(prepared) == {120}


@needs_amx
def test_the_amx_kernel_is_a_checked_option(monkeypatch):
    assert LookaheadConfig().amx_kernel is True
    with pytest.raises(ValueError, match="amx_kernel must be a bool"):
        LookaheadConfig(amx_kernel="yes")
    monkeypatch.setattr(hf, "row_kernels_for", lambda model, refresh=False, quiet=False: RowKernels(0, 64))
    model = _affine_model("llama", hidden_size=64, intermediate_size=128)
    prompt = repetitive_prompt(1)
    model.generate(prompt, do_sample=False, max_new_tokens=8, custom_generate=Lookahead(LookaheadConfig(
        amx_kernel=False)))
    kinds = {packed.panels.kind for packed in packed_weights(model) if packed.panels is not None}
    assert kinds == {"affine4h", "scaled8"}  # the layers on the streamed kernel, the Q8_0 head its own exact product
    assert model._lookahead_compact_weights is True
