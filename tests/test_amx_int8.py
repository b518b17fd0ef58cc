"""The AMX-INT8 kernel (`amx_int8.py`): its record layout and prepared pieces, products float32-accurate against
float64 for any row count and shape, each row's sums independent of the rows and threads computing it, a non-finite
input spoiling only its own row, its use for 8-bit block weights where the CPU has AMX-INT8, and greedy generation
through it identical to plain greedy (its head and its layers, fused). The kernel's tests run only on a CPU with
AMX-INT8."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from test_affine_weights import _affine_model
from test_amx_kernel import assert_rows_and_threads_do_not_matter, block_weight
from tiny_models import assert_plain_greedy, build_tiny_model

from lookahead import Lookahead, LookaheadConfig, affine_weights, amx_int8, fused_stack, hf, streamed_gemm
from lookahead.packed_linear import packed_weights
from lookahead.row_kernels import RowKernels
from lookahead.warmup_model import q8_0

needs_amx_int8 = pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and streamed_gemm.available()
                                         and amx_int8.available()), reason="needs a CPU with AMX-INT8 and AVX-512")


def _q8_0(n: int, k: int, seed: int) -> torch.Tensor:
    """A Q8_0-style float32 weight [n, k] (a float16 scale per block of 32, every weight d · q)."""
    return block_weight(q8_0, n, k, seed)


def test_records_hold_each_weights_code_and_scale_where_the_tiles_read_them():
    weight = _q8_0(21, 128, 0)
    scales, codes = affine_weights.scaled_form(weight)
    records = amx_int8.records(scales, codes)
    assert records.shape == (2, 4, amx_int8.RECORD) and records.dtype == torch.uint8
    d = records[:, :, :64].contiguous().view(torch.float32)  # panel, block, column
    tile = records[:, :, 64:].contiguous().view(torch.int8).view(2, 4, 8, 16, 4)  # panel, block, row, column, step
    for column in range(21):
        panel, n = divmod(column, 16)
        for block in range(4):
            assert d[panel, block, n].item() == scales[column, block].item()
            for row in range(8):
                step = 32 * block + 4 * row
                assert torch.equal(tile[panel, block, row, n], codes[column, step:step + 4])
    assert not d[1, :, 5:].any() and not tile[1, :, :, 5:].any()  # padding columns are zero


def test_it_fits_whole_pairs_of_blocks_and_sizes_its_scratch():
    assert amx_int8.fits(64) and amx_int8.fits(576) and not amx_int8.fits(96) and not amx_int8.fits(0)
    for rows in (2, 3, 16, 17, 40):
        for k in (64, 576, 1536):
            assert amx_int8.scratch_floats(rows, k) <= streamed_gemm.product_scratch(rows, k)
    assert streamed_gemm.scratch_floats("amx8", 3, 64) == amx_int8.scratch_floats(3, 64)


def _prepared(x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`transpose`'s output for rows x [M, K], group by group: (pieces [K/32, rows, PIECES, 32] int8, block scales
    [K/32, rows])."""
    rows, k = x.shape
    scratch = torch.zeros(amx_int8.scratch_floats(rows, k))
    transpose = ctypes.CFUNCTYPE(None, *[ctypes.c_int64] * 4)(amx_int8.addresses()[1])
    transpose(x.data_ptr(), scratch.data_ptr(), rows, k)
    raw = scratch.view(torch.uint8)[(-scratch.data_ptr()) % 64:]
    out, first, blocks = [], 0, k // 32
    while first < rows:
        size = min(amx_int8.GROUP, rows - first)
        pieces_bytes = blocks * size * amx_int8.PIECES * 32
        pieces = raw[:pieces_bytes].view(torch.int8).view(blocks, size, amx_int8.PIECES, 32)
        scales = raw[pieces_bytes:pieces_bytes + blocks * size * 4].view(torch.float32).view(blocks, size)
        out.append((pieces, scales))
        raw, first = raw[amx_int8._region_bytes(size, k):], first + size
    return out


@needs_amx_int8
@pytest.mark.parametrize("rows", [2, 5, 16, 17, 40])
def test_prepared_pieces_rebuild_each_input_within_its_blocks_bound(rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=generator) * torch.logspace(-3, 3, rows)[:, None]
    x[0, :32] = 0.0  # a zero block
    first = 0
    for pieces, scales in _prepared(x):
        size = pieces.shape[1]
        group = x[first:first + size].double().view(size, 4, 32).permute(1, 0, 2)  # block, row, step
        weights = torch.tensor([128.0 ** -p for p in range(amx_int8.PIECES)], dtype=torch.float64)
        rebuilt = (pieces.double() * weights[:, None]).sum(2) * scales.double()[:, :, None]
        top = group.abs().amax(-1)
        assert ((rebuilt - group).abs() <= top[:, :, None] * 2.0 ** -26).all()
        assert (pieces.abs() <= 64).all()
        assert (torch.frexp(scales)[0] == 0.5).all()  # powers of two: the pieces are exact
        nonzero = top > 0  # |x| / s in [32, 64): the first piece holds the block's top six bits
        assert ((top / scales.double())[nonzero] >= 32).all() and ((top / scales.double())[nonzero] < 64).all()
        first += size


@needs_amx_int8
@pytest.mark.parametrize("n, k", [(40, 128), (48, 64), (96, 576)])
def test_products_are_float32_accurate_for_any_row_count(n, k):
    weight = _q8_0(n, k, n)
    bias = torch.randn(n)
    packed = affine_weights.pack_stacked([weight[:7], weight[7:]], bias)
    assert packed.kind == "amx8" and packed.in_features == k and packed.out_features == n
    exact_weight = weight.double().t()
    for rows in (1, 2, 3, 4, 5, 8, 13, 16, 17, 33):
        generator = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, k, generator=generator) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=generator)]
        exact = x.double() @ exact_weight + bias.double()
        magnitude = x.double().abs() @ exact_weight.abs() + bias.double().abs()
        got = streamed_gemm.product(x, packed)
        assert got.shape == (rows, n)
        assert ((got.double() - exact).abs() / magnitude).max().item() < 5e-7, rows


@needs_amx_int8
def test_each_rows_sums_do_not_depend_on_the_rows_or_threads_computing_it():
    assert_rows_and_threads_do_not_matter(affine_weights.pack_stacked([_q8_0(80, 192, 3)]))


@needs_amx_int8
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_input_spoils_its_own_row_only(bad):
    packed = affine_weights.pack_stacked([_q8_0(32, 128, 5)])
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(6))
    clean = streamed_gemm.product(x, packed)
    x[2, 70] = bad
    got = streamed_gemm.product(x, packed)
    assert got[2].isnan().all()
    assert torch.equal(torch.cat([got[:2], got[3:]]), torch.cat([clean[:2], clean[3:]]))


@needs_amx_int8
def test_weights_it_does_not_fit_keep_the_streamed_kernels_form():
    assert affine_weights.pack_stacked([_q8_0(16, 96, 0)]).kind == "scaled8"  # K = 3 blocks, not whole pairs
    assert affine_weights.pack_stacked([_q8_0(16, 64, 0)], amx=False).kind == "scaled8"
    assert affine_weights.pack_stacked([_q8_0(16, 64, 0)]).kind == "amx8"


def test_its_records_prepare_their_rows_with_their_own_call():
    """A fused layer runs its four products with one prepare call: "amx8" records need the AMX-INT8 kernel's, so a
    layer mixing them with other kinds runs step by step."""
    if amx_int8.available():
        assert streamed_gemm.prepare_address("amx8") not in {streamed_gemm.prepare_address(kind)
                                                             for kind in ("float32", "scaled8", "amx4")}


def _q8_0_model(family: str) -> torch.nn.Module:
    """A tiny model of `family` (hidden 64) with every linear layer and the LM head in Q8_0 form."""
    model = build_tiny_model(family, dtype=torch.float32, seed=7, layers=3, hidden_size=64, intermediate_size=128)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(q8_0(module.weight))
    return model


@needs_amx_int8
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("config", [LookaheadConfig(), LookaheadConfig.off()], ids=["speculate", "off"])
def test_greedy_on_the_amx_int8_kernel_is_plain_greedy(family, config, monkeypatch):
    """Every product (layers fused into one compiled stack, and the head) on "amx8" records: greedy equals plain
    greedy."""
    monkeypatch.setattr(hf, "row_kernels_for", lambda model, refresh=False, quiet=False: RowKernels(0, 64))
    calls = []
    real = fused_stack.decoder_stack
    monkeypatch.setattr(fused_stack, "decoder_stack", lambda *args: calls.append(1) or real(*args))
    model = _q8_0_model(family)
    assert_plain_greedy(model, Lookahead(config))
    built = {packed.panels.kind for packed in packed_weights(model) if packed.panels is not None}
    assert built == {"amx8"} and calls


@needs_amx_int8
def test_the_default_models_head_runs_on_it_unless_amx_is_off():
    model = _affine_model("llama", hidden_size=64, intermediate_size=128)
    for amx, kind in ((True, "amx8"), (False, "scaled8")):
        model.generate(torch.tensor([[1, 2, 3, 1, 2]]), do_sample=False, max_new_tokens=4,
                       custom_generate=Lookahead(LookaheadConfig(amx_kernel=amx)))
        heads = [packed.panels for packed in packed_weights(model) if packed.linears == [model.lm_head]]
        assert [head.kind for head in heads] == [kind]
