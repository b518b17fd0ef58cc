"""Tests for lookahead/streamed_gemm.py: the streamed small-row kernel computes x @ Wᵀ + b for any row count and
shape, each row independently of the rows computed with it, on the AVX-512 and the AVX2 layouts, and refuses
what it cannot compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lookahead import streamed_gemm
from lookahead.streamed_gemm import pack, product

needs_kernel = pytest.mark.skipif(not streamed_gemm.available(), reason="streamed kernel not built on this machine")


def _reference(x, weight, bias=None):
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).float()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 12, 16, 17, 33])
@pytest.mark.parametrize("out_features, in_features, bias", [(64, 48, False), (80, 37, True), (5, 3, True)])
def test_the_product_matches_float64_for_any_row_count_and_shape(rows, out_features, in_features, bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    x = torch.randn(rows, in_features, generator=generator)
    got = product(x, pack(weight, b))
    assert got.shape == (rows, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, _reference(x, weight, b), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_each_row_is_computed_as_if_alone_and_on_any_thread_count():
    generator = torch.Generator().manual_seed(7)
    weight = pack(torch.randn(200, 96, generator=generator))
    x = torch.randn(20, 96, generator=generator)
    together = product(x, weight)
    for i in range(20):
        assert torch.equal(product(x[i:i + 1], weight), together[i:i + 1])  # bit-identical, not merely close
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(product(x, weight), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("heights", [(5, 20, 3), (16, 32), (7,), (1, 1, 1, 40)])
def test_stacked_weights_are_packed_as_their_concatenation(heights):
    """Row blocks that start and end inside a panel, whole panels, and padding: the same panels as packing the
    stacked matrix (built here the simple way)."""
    generator = torch.Generator().manual_seed(sum(heights))
    weights = [torch.randn(h, 9, generator=generator) for h in heights]
    stacked = torch.cat(weights)
    width = streamed_gemm.vector_width()
    padded = torch.cat([stacked, stacked.new_zeros(-len(stacked) % width, 9)])
    expected = padded.reshape(-1, width, 9).transpose(1, 2)
    bias = torch.randn(len(stacked), generator=generator)
    packed = streamed_gemm.pack_stacked(weights, bias)
    assert torch.equal(packed.panels, expected) and packed.out_features == len(stacked)
    assert torch.equal(packed.bias, bias)
    with pytest.raises(ValueError, match="one width"):
        streamed_gemm.pack_stacked([torch.randn(4, 9), torch.randn(4, 8)])


@needs_kernel
@pytest.mark.parametrize("width, per_pass", [(8, 12), (16, 16)])
def test_rows_beyond_one_pass_are_computed_in_groups_each_as_if_alone(monkeypatch, width, per_pass):
    """More rows than one pass holds (groups of `per_pass` over each panel, the last smaller), on the AVX2 and the
    AVX-512 layouts compiled here: right, and every row bit-identical to the row computed alone."""
    monkeypatch.setattr(streamed_gemm, "vector_width", lambda: width)
    streamed_gemm._kernel_address.cache_clear()
    try:
        assert streamed_gemm.rows_per_pass() == per_pass
        generator = torch.Generator().manual_seed(width)
        weight, x = torch.randn(5 * width + 3, 41, generator=generator), torch.randn(2 * per_pass + 5, 41)
        packed = pack(weight)
        together = product(x, packed)
        torch.testing.assert_close(together, _reference(x, weight), rtol=1e-5, atol=1e-5)
        for rows in (1, per_pass - 1, per_pass, per_pass + 1, 2 * per_pass):
            assert torch.equal(product(x[:rows], packed), together[:rows])
        assert torch.equal(product(x[-1:], packed), together[-1:])
    finally:
        streamed_gemm._kernel_address.cache_clear()


@needs_kernel
def test_the_avx2_layout_computes_the_same_product(monkeypatch):
    """Eight-float panels and at most 12 rows per pass (what an AVX2 machine uses), compiled here."""
    monkeypatch.setattr(streamed_gemm, "vector_width", lambda: 8)
    streamed_gemm._kernel_address.cache_clear()
    try:
        assert streamed_gemm.rows_per_pass() == 12
        weight, x = torch.randn(44, 30), torch.randn(14, 30)
        packed = pack(weight)
        assert packed.panels.shape == (6, 30, 8)
        torch.testing.assert_close(product(x, packed), _reference(x, weight), rtol=1e-5, atol=1e-5)
    finally:
        streamed_gemm._kernel_address.cache_clear()


def test_the_kernel_is_available_on_a_cpu_with_fma():
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    if "fma" not in flags and "avx512f" not in flags:
        pytest.skip("this CPU has no FMA: the kernel is not built here (by design)")
    assert streamed_gemm.available()


def test_the_generated_ir_has_one_function_per_row_count_a_dispatcher_and_the_transpose():
    ir = streamed_gemm.module_ir(16, 3)
    assert [line.split("@")[1].split("(")[0] for line in ir.splitlines() if line.startswith("define")] == [
        "rows1", "rows2", "rows3", "streamed_rows", "transpose"]
    # One multiply-add per row and step in each panel loop: for 1–2 rows, a loop over two panels at once and one
    # for the panel left over; for 3 rows, one loop of one panel.
    assert [streamed_gemm.panels_per_pass("float32", rows, 16) for rows in (1, 2, 3)] == [2, 2, 1]
    assert ir.count("call <16 x float> @llvm.fma.v16f32") == 1 * (2 + 1) + 2 * (2 + 1) + 3


@needs_kernel
def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="float32"):
        pack(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D"):
        pack(torch.randn(4))
    weight = pack(torch.randn(16, 8))
    with pytest.raises(ValueError, match=r"x \[M, 8\]"):
        product(torch.randn(2, 9), weight)
    with pytest.raises(ValueError, match="float32"):
        product(torch.randn(2, 8, dtype=torch.float64), weight)


@needs_kernel
def test_the_kernel_is_not_used_on_numbas_thread_unsafe_workqueue_layer(monkeypatch):
    import numba

    monkeypatch.setattr(numba, "threading_layer", lambda: "workqueue")
    streamed_gemm.available.cache_clear()
    try:
        assert not streamed_gemm.available()
    finally:
        streamed_gemm.available.cache_clear()


def test_panels_are_float32_whatever_the_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        packed = streamed_gemm.pack_stacked([torch.randn(5, 9, dtype=torch.float32)])
    finally:
        torch.set_default_dtype(previous)
    assert packed.panels.dtype == torch.float32


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 16, 17])
@pytest.mark.parametrize("out_features, in_features", [(64, 48), (83, 37), (5, 3)])
def test_int8_panels_compute_the_product_of_the_rounded_weight(rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    weight[-1] = 0.0  # a zero row: scale 1, all zeros
    quantized = streamed_gemm.quantize(weight)
    assert quantized.panels.dtype == torch.int8 and quantized.scales.shape == (out_features,)
    rounded = quantized.panels.permute(0, 2, 1).reshape(-1, in_features)[:out_features].double()
    assert float(rounded.abs().max()) <= 127 and float(quantized.scales[-1]) == 1.0
    dequantized = rounded * quantized.scales.double()[:, None]
    assert bool(((dequantized - weight.double()).abs() <= quantized.scales.double()[:, None] / 2 + 1e-12).all())
    x = torch.randn(rows, in_features, generator=generator)
    torch.testing.assert_close(product(x, quantized), (x.double() @ dequantized.T).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("picked", [[3], [0, 17, 18, 129, 299], list(range(8)), [5, 5, 250, 1, 9, 9, 2, 0, 77]])
def test_rows_gathered_into_panels_are_the_panels_of_the_gathered_rows(picked, monkeypatch):
    """`pack_rows` (one compiled gather, used by the LM head for its candidate tokens) writes exactly the panels
    `pack(weight[rows])` writes, padding zeros included, into panels that held NaN."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *shape, **kw: empty(*shape, **kw).fill_(float("nan")))
    generator = torch.Generator().manual_seed(len(picked))
    weight = torch.randn(300, 70, generator=generator)
    rows = torch.tensor(picked)
    expected = pack(weight[rows])
    got = streamed_gemm.pack_rows(weight, rows.numpy())
    assert got.panels.shape == expected.panels.shape and torch.equal(got.panels, expected.panels)
    assert got.out_features == len(picked) and got.bias is None and got.kind == "float32"


@needs_kernel
def test_a_few_weight_rows_packed_alone_give_the_full_products_numbers_bit_for_bit():
    """What `argmax_head` relies on: an output's multiply-adds do not depend on the other rows packed with it."""
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(300, 70, generator=generator)
    x = torch.randn(5, 70, generator=generator)
    picked = torch.tensor([0, 17, 18, 129, 299])
    assert torch.equal(product(x, pack(weight[picked])), product(x, pack(weight))[:, picked])


def test_the_int8_kernel_converts_each_weight_vector_once():
    for width, together in ((8, 3), (16, 6)):
        ir = streamed_gemm.module_ir(width, 2, "int8")
        # Per row-count function, once per panel of each loop: `together` panels at once and the one left over.
        assert [streamed_gemm.panels_per_pass("int8", rows, width) for rows in (1, 2)] == [together, together]
        converted = 2 * (together + 1)
        assert ir.count(f"sext <{width} x i8>") == converted and ir.count(f"sitofp <{width} x i32>") == converted
        fmas = ir.count(f"call <{width} x float> @llvm.fma.v{width}f32")
        assert fmas == 1 * (together + 1) + 2 * (together + 1)  # one per row and panel


def test_int8_passes_of_several_panels_prefetch_the_next_pass_where_measured_faster():
    """AVX2 (8 floats): a pass of 3 int8 panels prefetches each panel's step 3 panels (3 · K vectors of 8 bytes)
    further, the panel left over its usual distance; AVX-512 keeps the usual distance everywhere."""
    for width, together in ((8, 3), (16, 6)):
        ir = streamed_gemm.kernel_ir(1, width, weights="int8")
        next_pass = streamed_gemm.INT8_PREFETCH_NEXT_PASS[width]
        assert ir.count(f"mul i64 %K, {together * width}") == (1 if next_pass else 0)
        usual = f"i64 {streamed_gemm.PREFETCH_STEPS * width * 4}\n"
        prefetches = ir.count("@llvm.prefetch.p0(")
        assert prefetches == together + 1
        assert (ir + "\n").count(usual) == (1 if next_pass else together + 1)


@needs_kernel
@pytest.mark.parametrize("weights", ["float32", "int8"])
@pytest.mark.parametrize("columns", [8, 4 * 8 + 3, 7 * 16, 15 * 16 + 3, 29 * 16])
def test_panels_computed_together_give_each_column_its_own_sum(weights, columns):
    """Row counts that compute several panels at once (`panels_per_pass` at this CPU's width), on panel counts that
    leave panels over (also per thread): every row bit-identical to the same row computed among rows that take one
    panel at a time."""
    generator = torch.Generator().manual_seed(columns)
    weight = torch.randn(columns, 40, generator=generator)
    packed = streamed_gemm.quantize(weight) if weights == "int8" else pack(weight)
    x = torch.randn(5, 40, generator=generator)
    table = streamed_gemm.PANELS_PER_PASS[streamed_gemm.vector_width()][weights]
    assert 5 not in table
    alone = product(x, packed)
    for rows in table:
        assert torch.equal(product(x[:rows], packed), alone[:rows]), rows
