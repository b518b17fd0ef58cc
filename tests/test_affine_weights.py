"""Weights in their exact 4-bit form (`affine_weights.py`, `streamed_gemm.affine_kernel_ir`): found only where every
weight equals fma(q, d, m) bit for bit, products bit-identical to the float32 panels' for any row count and
layout, and generation through them identical to plain greedy, with the compact panels in use. The AMX kernel's
layout, which a CPU with AMX gets instead for 4-bit weights, is switched off here (`test_amx_kernel.py` tests it)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import assert_plain_greedy, build_tiny_model, repetitive_prompt, three_steps

from lookahead import (Lookahead, LookaheadConfig, affine_tiles, affine_tiles512, affine_weights, amx_kernel, hf,
                       streamed_gemm)
from lookahead.affine_weights import affine_form
from lookahead.compiled_ir import host_features
from lookahead.attention import tree_attention
from lookahead.lean_layers import lean_layers
from lookahead.packed_linear import packed_linears, packed_weights
from lookahead.row_kernels import RowKernels, apply_row_kernels
from lookahead.warmup_model import q4_1, q8_0

needs_kernel = pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and streamed_gemm.available()),
                                  reason="needs oneDNN and the streamed kernel (a CPU with FMA)")


@pytest.fixture(autouse=True)
def _streamed_block_forms(monkeypatch):
    """The streamed kernel's block forms, as on a CPU without AMX."""
    monkeypatch.setattr(amx_kernel, "available", lambda: False)


def _block_codes(n: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(4-bit codes [n, k / 32, 32], every block holding codes 0 and 15; float16-valued scales [n, k / 32, 1])."""
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=generator)
    codes[..., 0], codes[..., 1] = 0, 15
    return codes, torch.rand(n, k // 32, 1, generator=generator).half().float()


def q4_0(n: int, k: int, seed: int) -> torch.Tensor:
    """A Q4_0-style weight: d·(q - 8), every block holding codes 0 and 15."""
    codes, scale = _block_codes(n, k, torch.Generator().manual_seed(seed))
    return (scale * (codes - 8)).reshape(n, k)


def _four_bit_kind() -> str:
    """The panels GGUF-style 4-bit weights (float16 scales and offsets) get here: float16 records with AVX-512."""
    return "affine4h" if streamed_gemm.vector_width() == 16 else "affine4"


def _rebuilt(form) -> torch.Tensor:
    scales, offsets, codes = form
    return torch.addcmul(offsets.repeat_interleave(32, 1), codes.float(), scales.repeat_interleave(32, 1))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("weight", [q4_1(torch.randn(70, 96)), q4_0(40, 64, 1), q4_1(torch.randn(3, 32) * 1e-3),
                                    torch.zeros(8, 32)], ids=["q4_1", "q4_0", "small", "zeros"])
def test_the_form_is_found_and_rebuilds_every_weight_bit_for_bit(weight):
    form = affine_form(weight)
    assert form is not None
    scales, offsets, codes = form
    assert scales.shape == offsets.shape == (weight.shape[0], weight.shape[1] // 32)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert _bits_equal(_rebuilt(form), weight)


def test_weights_without_the_form_are_refused():
    weight = q4_1(torch.randn(100, 64))
    assert affine_form(weight) is not None
    for row in (0, 99):  # the probed rows, and a row only the whole check reaches
        nudged = weight.clone()
        nudged[row, 17] = torch.nextafter(nudged[row, 17], torch.tensor(float("inf")))  # one ulp off one weight
        assert affine_form(nudged) is None
    assert affine_form(torch.randn(16, 64)) is None  # trained float32 weights
    assert affine_form(torch.randn(16, 64).bfloat16().float()) is None  # bfloat16 values: 17 levels a block and more
    assert affine_form(q4_1(torch.randn(16, 64))[:, :48]) is None  # K not a multiple of 32
    assert affine_form(q4_1(torch.randn(16, 64)).double()) is None
    infinite = weight.clone()
    infinite[3, 3] = float("inf")
    assert affine_form(infinite) is None
    codes = torch.arange(32).remainder(16).float().repeat(16, 2)
    assert affine_form(codes * 0.1 - 1.0) is None  # d = float32 0.1, no float16 value: d·q would not be exact
    assert affine_form(codes * 0.125 - 1.0) is not None  # the same codes with a float16 scale


def _reference_first_fit(values, exact, offset, codes_range, codes_dtype=torch.float32):
    """`affine_weights._first_fit` as tensor operations: every candidate tried on the blocks still open, gathered by
    index, all blocks at once."""
    values, offset, exact = (t.reshape(-1, *t.shape[2:]) for t in (values, offset, exact))
    half = exact.to(torch.float16)
    candidates = (half.float(), torch.nextafter(half, half.new_full((), float("inf"))).float(),
                  torch.nextafter(half, half.new_zeros(())).float())
    scale, codes = torch.zeros_like(offset), torch.zeros(values.shape)
    open_blocks = torch.arange(len(values))
    for candidate in candidates:
        d, block, base = candidate[open_blocks], values[open_blocks], offset[open_blocks]
        q = torch.where(d > 0, (block - base) / torch.where(d > 0, d, 1.0), 0.0).round().clamp(*codes_range)
        fits = (torch.addcmul(base, q, d).view(torch.int32) == block.view(torch.int32)).all(-1)
        scale[open_blocks[fits]], codes[open_blocks[fits]] = d[fits], q[fits]
        open_blocks = open_blocks[~fits]
        if not len(open_blocks):
            return scale, codes.to(codes_dtype)
    return None


def _reference_form(weight: torch.Tensor, affine: bool):
    """`affine_form(weight)` (`affine`) or `scaled_form(weight)` as tensor operations: (scales, offsets, codes as
    float32) or None."""
    n, k = weight.shape
    if affine:
        inputs = _search_inputs(weight)
    else:
        values = weight.reshape(n, k // 32, 32)
        top = values.abs().amax(-1, keepdim=True)
        inputs = (values, top.double() / 127, torch.zeros_like(top), (-127, 127))
    if not bool(torch.isfinite(inputs[1]).all()):
        return None
    found = _reference_first_fit(*inputs)
    return None if found is None else (found[0].reshape(n, -1), inputs[2].reshape(n, -1), found[1].reshape(n, k))


def _same_form(found, expected) -> bool:
    """Whether the compiled search's form (`affine_form`'s or `scaled_form`'s) is the reference's bit for bit."""
    scales, offsets, codes = expected
    if len(found) == 2:  # scaled_form: (d, q), the offsets all zero
        found = (found[0], torch.zeros_like(found[0]), found[1])
    return _bits_equal(found[0], scales) and _bits_equal(found[1], offsets) and torch.equal(found[2].float(), codes)


def test_the_compiled_search_finds_the_reference_forms_bit_for_bit():
    """The compiled search gives the very scales, offsets and codes of the search written as tensor operations, zero
    blocks, blocks that need a float16 neighbour and the 8-bit form included, and refuses a weight one of whose last
    blocks has no form, or that holds a NaN."""
    weight = q4_1(torch.randn(40, 256, generator=torch.Generator().manual_seed(5)))
    weight[3] = 0.0  # blocks of zeros: d = 0
    for case in (weight, q4_0(30, 128, 2), _needs_neighbours(64)):
        assert _same_form(affine_form(case), _reference_form(case, True))
    for case in (q8_0(torch.randn(30, 128)), q8_0(torch.randn(4, 64) * 1e-6), torch.zeros(3, 32)):
        assert _same_form(affine_weights.scaled_form(case), _reference_form(case, False))
    nudged = weight.clone()
    nudged[39, 250] = torch.nextafter(nudged[39, 250], torch.tensor(float("inf")))  # in the last block
    assert affine_form(nudged) is None and _reference_form(nudged, True) is None
    signed = weight.clone()
    signed[5, :32] = -0.0  # -0.0 + 0·d rounds to +0.0: the sign of zero is compared too, by both
    assert affine_form(signed) is None and _reference_form(signed, True) is None
    for form, affine in ((affine_form, True), (affine_weights.scaled_form, False)):
        missing = weight.clone()
        missing[20, 70] = float("nan")  # NaN is neither a block's minimum nor its maximum, and never rebuilt
        assert form(missing) is None and _reference_form(missing, affine) is None


def test_the_scale_candidates_are_torchs_float16_and_its_neighbours():
    """`_candidates` rounds a float64 scale to float16 as torch does (through float32: ties to even twice), then
    takes the float16 neighbours above and towards zero, over float16's whole range: subnormals, the smallest
    normal, halfway cases, the largest value and past it."""
    generator = torch.Generator().manual_seed(3)
    halves = torch.arange(0, 0x7C01, dtype=torch.int32).to(torch.int16).view(torch.float16)  # 0 … +inf
    spacing = torch.nextafter(halves, halves.new_full((), float("inf"))).double() - halves.double()
    between = halves.double() + spacing * torch.tensor([0.25, 0.5, 0.75]).double()[:, None]  # ties included
    scales = torch.cat([halves.double(), between.flatten(), torch.rand(2000, generator=generator, dtype=torch.float64),
                        1 + 2.0 ** -11 + torch.tensor([2.0 ** -40, -(2.0 ** -40)], dtype=torch.float64),
                        torch.tensor([65519.9, 65520.0, 1e6, 2.0 ** -25, 2.0 ** -26, 0.0], dtype=torch.float64)])
    scales = scales[torch.isfinite(scales)]
    half = scales.to(torch.float16)
    expected = torch.stack([half, torch.nextafter(half, half.new_full((), float("inf"))),
                            torch.nextafter(half, half.new_zeros(()))], dim=1).float()
    found = torch.tensor([affine_weights._candidates(float(x)) for x in scales], dtype=torch.float32)
    assert _bits_equal(found, expected)


def _needs_neighbours(n: int) -> torch.Tensor:
    """n rows of one block each, fma(q, d, 8.0) with float16 scales d near 2^-14: next to an offset of 8.0 the
    block's rounded max - min strays so far from 15 d that for some blocks d is a float16 neighbour of the
    nearest float16 to (max - min) / 15 — the later candidates are needed (checked)."""
    generator = torch.Generator().manual_seed(0)
    scales = (2.0 ** -14 * (1 + torch.randint(0, 1024, (n, 1), generator=generator) / 1024)).half().float()
    codes = torch.randint(0, 16, (n, 32), generator=generator).float()
    codes[:, 0], codes[:, 1] = 0, 15
    weight = torch.addcmul(torch.full((n, 1), 8.0), codes, scales)
    values, exact, _, _ = _search_inputs(weight)
    assert (exact.to(torch.float16).float().reshape(n, 1) != scales).any()
    return weight


def _search_inputs(weight):
    """`_first_fit`'s arguments for `affine_form(weight)`."""
    n, k = weight.shape
    values = weight.reshape(n, k // 32, 32)
    low, high = values.amin(-1, keepdim=True), values.amax(-1, keepdim=True)
    return values, (high.double() - low.double()) / affine_weights.LEVELS, low, (0, affine_weights.LEVELS)


@pytest.mark.parametrize("weight", [q8_0(torch.randn(70, 96)), q8_0(torch.randn(5, 32) * 1e-4)], ids=["q8_0", "small"])
def test_the_scaled_form_is_found_and_rebuilds_every_weight_bit_for_bit(weight):
    scales, codes = affine_weights.scaled_form(weight)
    assert scales.shape == (weight.shape[0], weight.shape[1] // 32) and codes.dtype == torch.int8
    assert _bits_equal(scales.repeat_interleave(32, 1) * codes.float(), weight)
    assert affine_form(weight) is None  # 8-bit codes: more than 16 levels a block


def test_weights_without_the_scaled_form_are_refused():
    weight = q8_0(torch.randn(100, 64))
    nudged = weight.clone()
    nudged[99, 40] = torch.nextafter(nudged[99, 40], torch.tensor(float("inf")))
    assert affine_weights.scaled_form(nudged) is None
    assert affine_weights.scaled_form(torch.randn(16, 64)) is None
    assert affine_weights.scaled_form(weight[:, :40]) is None
    signed_zero = weight.clone()
    signed_zero[50, 3] = -0.0  # equal to 0 but not 0 · d: its sign would be lost
    assert affine_weights.scaled_form(signed_zero) is None


def test_the_scaled_record_layout_holds_each_weights_code_and_scale():
    weight = q8_0(torch.randn(19, 64))
    packed = affine_weights.pack_stacked([weight])
    width = streamed_gemm.vector_width()
    assert packed.kind == "scaled8" and packed.in_features == 64 and packed.panels.shape[2] == 9
    records = packed.panels
    codes = records[:, :, 1:].contiguous().view(torch.int8).reshape(records.shape[0], 2, 32, width)
    decoded = torch.empty(records.shape[0] * width, 64)
    for column in range(decoded.shape[0]):
        block, lane = divmod(column, width)
        for k in range(64):
            scale = records[block, k // 32, 0, lane:lane + 1].view(torch.float32)
            decoded[column, k] = scale * float(codes[block, k // 32, k % 32, lane])
    assert _bits_equal(decoded[:19], weight) and not decoded[19:].any()


def q4_1_float32_offsets(n: int, k: int, seed: int) -> torch.Tensor:
    """A 4-bit weight fma(q, d, m) whose block offsets m float16 cannot hold (d float16, codes 0 and 15 in every
    block, so the form is found)."""
    generator = torch.Generator().manual_seed(seed)
    codes, scale = _block_codes(n, k, generator)
    offset = -torch.rand(n, k // 32, 1, generator=generator) - 1e-4  # float32 values between float16's
    assert not affine_weights.half_exact(offset)
    return torch.addcmul(offset, codes.float(), scale).reshape(n, k)


def test_the_record_layout_holds_each_weights_code_scale_and_offset(monkeypatch):
    """Decode the panels by the layout `affine_kernel_ir` documents, in Python: the weight again, padding zero."""
    monkeypatch.setattr(affine_weights, "half_exact", lambda values: False)  # the float32 record ("affine4")
    weight = q4_1(torch.randn(21, 64))
    packed = affine_weights.pack_stacked([weight[:5], weight[5:]])
    width = streamed_gemm.vector_width()
    assert packed.kind == "affine4" and packed.in_features == 64 and packed.out_features == 21
    panels = packed.panels
    assert panels.shape == (-(-21 // width), 2, 6, width) and panels.dtype == torch.int32
    decoded = torch.empty(panels.shape[0] * width, 64)
    for column in range(decoded.shape[0]):
        block, lane = divmod(column, width)
        for k in range(64):
            record = panels[block, k // 32]
            scale, offset = record[0, lane:lane + 1].view(torch.float32), record[1, lane:lane + 1].view(torch.float32)
            code = (int(record[2 + (k % 32) // 8, lane]) >> (4 * (k % 8))) & 15
            decoded[column, k] = torch.addcmul(offset, torch.tensor([float(code)]), scale)
    assert _bits_equal(decoded[:21], weight) and not decoded[21:].any()


def test_the_float16_record_layout_holds_each_weights_code_scale_and_offset(monkeypatch):
    """The "affine4h" record (AVX-512 width): d and m as the float16 halves of one word, then the code lanes."""
    monkeypatch.setattr(streamed_gemm, "vector_width", lambda: 16)
    weight = q4_1(torch.randn(21, 64))
    packed = affine_weights.pack_stacked([weight[:5], weight[5:]])
    assert packed.kind == "affine4h" and packed.in_features == 64 and packed.out_features == 21
    panels = packed.panels
    assert panels.shape == (2, 2, 5, 16) and panels.dtype == torch.int32
    decoded = torch.empty(32, 64)
    for column in range(32):
        block, lane = divmod(column, 16)
        for k in range(64):
            record = panels[block, k // 32]
            halves = record[0, lane:lane + 1].view(torch.int16)  # little-endian: d first, then m
            scale, offset = halves[0:1].view(torch.float16).float(), halves[1:2].view(torch.float16).float()
            code = (int(record[1 + (k % 32) // 8, lane]) >> (4 * (k % 8))) & 15
            decoded[column, k] = torch.addcmul(offset, torch.tensor([float(code)]), scale)
    assert _bits_equal(decoded[:21], weight) and not decoded[21:].any()


@needs_kernel
@pytest.mark.parametrize("width", [8, 16])
def test_offsets_float16_cannot_hold_keep_the_float32_record(width, monkeypatch):
    monkeypatch.setattr(streamed_gemm, "vector_width", lambda: width)
    streamed_gemm._kernel_address.cache_clear()
    try:
        weight = q4_1_float32_offsets(2 * width + 3, 64, seed=width)
        packed = affine_weights.pack_stacked([weight])
        assert packed.kind == "affine4"
        x = torch.randn(3, 64)
        assert torch.equal(streamed_gemm.product(x, packed), streamed_gemm.product(x, streamed_gemm.pack(weight)))
    finally:
        streamed_gemm._kernel_address.cache_clear()


@needs_kernel
@pytest.mark.parametrize("width, form, rounding", [(8, "affine4", q4_1), (16, "affine4", q4_1), (16, "affine4h", q4_1),
                                                   (8, "scaled8", q8_0), (16, "scaled8", q8_0)])
def test_products_are_bit_identical_to_the_float32_panels_for_any_row_count(monkeypatch, width, form, rounding):
    """Every row count from 1 to past two passes (rows computed several panels at once, panels left over, groups
    of rows), with a bias, on the AVX2 and the AVX-512 layouts compiled here (with AVX-512, 4-bit weights with
    float16 scales and offsets take the float16 record unless told not to), one thread and two."""
    monkeypatch.setattr(streamed_gemm, "vector_width", lambda: width)
    if form == "affine4":
        monkeypatch.setattr(affine_weights, "half_exact", lambda values: False)
    streamed_gemm._kernel_address.cache_clear()
    try:
        generator = torch.Generator().manual_seed(width)
        weight = rounding(torch.randn(9 * width + 3, 96, generator=generator))  # 10 panels: 3 + 2 per thread
        bias = torch.randn(len(weight), generator=generator)
        compact, plain = affine_weights.pack_stacked([weight], bias), streamed_gemm.pack(weight, bias)
        assert compact.kind == form
        for threads in (1, 2):
            with _threads(threads):
                for rows in range(1, 2 * streamed_gemm.rows_per_pass() + 4):
                    x = torch.randn(rows, 96, generator=generator)
                    assert torch.equal(streamed_gemm.product(x, compact), streamed_gemm.product(x, plain)), rows
    finally:
        streamed_gemm._kernel_address.cache_clear()


@needs_kernel
def test_the_kernel_is_checked_before_use():
    assert affine_weights.affine_available()
    mixed = affine_weights.pack_stacked([q4_1(torch.randn(8, 64)), torch.randn(8, 64)])
    assert mixed.kind == "float32"  # one member without the form: the whole stack on float32 panels


def _affine_model(family: str, **extra):
    """A tiny float32 model as the default model's GGUF holds it: its decoder layers' linear weights rounded to Q4_1
    values, its LM head to Q8_0 values."""
    model = build_tiny_model(family, dtype=torch.float32, seed=5, layers=3, **extra)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
                module.weight.copy_(q4_1(module.weight))
        model.lm_head.weight.copy_(q8_0(model.lm_head.weight))
    return model


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_steps_on_compact_weights_equal_the_float32_panels_bit_for_bit(family):
    model = _affine_model(family)
    prompt = repetitive_prompt(3)
    results = {}
    for compact in (True, False):
        with torch.no_grad(), packed_linears(model, compact=compact), tree_attention(model), lean_layers(model):
            apply_row_kernels(model, RowKernels(0, 64))
            logits, _ = three_steps(model, prompt)
            kinds = {packed.streamed().kind for packed in packed_weights(model)}
        results[compact] = logits
        assert kinds == ({_four_bit_kind(), "scaled8"} if compact else {"float32"})
    for with_form, without in zip(results[True], results[False]):
        assert torch.equal(with_form, without)


@needs_kernel
@pytest.mark.parametrize("family, extra", [("llama", {}), ("qwen2", {}), ("llama", {"intermediate_size": 96})],
                         ids=["llama", "qwen2", "llama-odd-width"])
@pytest.mark.parametrize("config", [LookaheadConfig(), LookaheadConfig.off()], ids=["speculate", "off"])
def test_greedy_on_compact_weights_is_plain_greedy(family, extra, config, monkeypatch):
    monkeypatch.setattr(hf, "row_kernels_for", lambda model, refresh=False, quiet=False: RowKernels(0, 64))
    model = _affine_model(family, **extra)
    assert_plain_greedy(model, Lookahead(config))
    built = [packed.panels.kind for packed in packed_weights(model) if packed.panels is not None]
    assert built.count(_four_bit_kind()) == 4 * 3  # per layer: the q/k/v and gate/up stacks, o and down


@needs_kernel
@pytest.mark.parametrize("config", [LookaheadConfig(seed=11), replace(LookaheadConfig.off(), seed=11)],
                         ids=["speculate", "off"])
def test_seeded_sampling_on_compact_weights_equals_float32_panels(config, monkeypatch):
    """Sampling reads the LM head's full logits, from "scaled8" panels here: the same seeded tokens as on float32
    panels (same bits), with the compact head in use."""
    monkeypatch.setattr(hf, "row_kernels_for", lambda model, refresh=False, quiet=False: RowKernels(0, 64))
    model = _affine_model("llama")
    outputs = {}
    for compact in (True, False):
        lookahead = Lookahead(replace(config, compact_weights=compact))
        outputs[compact] = model.generate(repetitive_prompt(4), do_sample=True, temperature=0.8, max_new_tokens=40,
                                          custom_generate=lookahead)
        if compact:
            assert "scaled8" in [p.panels.kind for p in packed_weights(model) if p.panels is not None]
    assert torch.equal(outputs[True], outputs[False])


def test_compact_weights_is_a_checked_option():
    assert LookaheadConfig().compact_weights is True
    with pytest.raises(ValueError, match="compact_weights must be a bool"):
        LookaheadConfig(compact_weights="yes")


@pytest.fixture
def avx2_width(monkeypatch):
    """Panels and kernels 8 floats wide, as on an AVX2 CPU, whatever this CPU has (the kernels compiled for the
    width are dropped before and after, so the rest of the run gets this CPU's own)."""
    monkeypatch.setattr(streamed_gemm, "vector_width", lambda: affine_tiles.WIDTH)
    streamed_gemm._kernel_address.cache_clear()
    yield
    streamed_gemm._kernel_address.cache_clear()


@needs_kernel
@pytest.mark.skipif("+avx2" not in host_features().split(","), reason="tiles are written for AVX2")
@pytest.mark.parametrize("columns", [7 * 8, 11 * 8 - 5, 8])
def test_tiles_leave_every_sum_bit_identical_to_the_float32_panels(columns, avx2_width):
    """Every tiled row count on panel counts that leave panels over after the tiles (also per thread), one thread
    and two, K of one and of three records. On an AVX-512 CPU the panels are packed 8 wide as on AVX2, so the
    tiles (AVX2 instructions, which AVX-512 CPUs run too) are tested there as well."""
    _assert_tiles_bit_identical(columns, affine_tiles.TILE_PANELS, "affine4")


def _assert_tiles_bit_identical(columns: int, tiles: dict, kind: str) -> None:
    """Products of every row count in `tiles` on `kind` panels of a Q4_1 weight of `columns` columns equal the
    float32 panels' bit for bit, K of one and of three records, one thread and two."""
    generator = torch.Generator().manual_seed(columns)
    for k in (32, 96):
        weight = q4_1(torch.randn(columns, k, generator=generator))
        compact, plain = affine_weights.pack_stacked([weight]), streamed_gemm.pack(weight)
        assert compact.kind == kind
        for threads in (1, 2):
            with _threads(threads):
                for rows in sorted(tiles):
                    x = torch.randn(rows, k, generator=generator)
                    assert torch.equal(streamed_gemm.product(x, compact), streamed_gemm.product(x, plain)), rows


def test_a_tile_must_fit_the_vector_registers():
    assert affine_tiles.tile_assembly(3, 3)[0].count("vfmadd231ps") == 3 * 3 * 32
    with pytest.raises(ValueError, match="does not fit"):
        affine_tiles.tile_assembly(5, 3)


needs_avx512 = pytest.mark.skipif("+avx512f" not in host_features().split(","), reason="tiles written for AVX-512")


@needs_kernel
@needs_avx512
@pytest.mark.parametrize("tiles", [affine_tiles512.TILE_PANELS, {1: 1, 4: 3, 6: 3, 8: 3}, {2: 2, 7: 2, 8: 1}])
@pytest.mark.parametrize("columns", [7 * 16, 11 * 16 - 5, 16])
def test_avx512_tiles_leave_every_sum_bit_identical_to_the_float32_panels(columns, tiles, monkeypatch):
    """The shipped AVX-512 tiles and others (offsets and code mask in registers or read from the scratch area, one
    panel to three) on panel counts that leave panels over after the tiles (also per thread), one thread and two, K
    of one and of three records, every row count of a tile computed on "affine4h" panels."""
    monkeypatch.setattr(affine_tiles512, "TILE_PANELS", tiles)
    streamed_gemm._kernel_address.cache_clear()
    try:
        _assert_tiles_bit_identical(columns, tiles, "affine4h")
    finally:
        streamed_gemm._kernel_address.cache_clear()


def test_an_avx512_tile_must_fit_the_vector_registers():
    text = affine_tiles512.tile_assembly(8, 3)[0]
    assert text.count("vfmadd231ps") == 8 * 3 * 32 and "vcvtph2ps" in text
    with pytest.raises(ValueError, match="does not fit"):
        affine_tiles512.tile_assembly(9, 3)


def test_avx512_tiles_are_used_only_for_their_row_counts_on_float16_records(monkeypatch):
    wide = affine_tiles512.WIDTH
    monkeypatch.setattr(affine_tiles, "host_features", lambda: "+avx,+avx2,+fma,-avx512f")
    assert not affine_tiles.tiled(5, wide, "affine4h")
    monkeypatch.setattr(affine_tiles, "host_features", lambda: "+avx,+avx2,+fma,+avx512f")
    assert affine_tiles.tiled(5, wide, "affine4h") and not affine_tiles.tiled(5, wide, "affine4")
    assert not affine_tiles.tiled(4, wide, "affine4h")  # four rows stay on the LLVM kernel's three panels


class _threads:
    """Within the block, torch uses `count` threads."""

    def __init__(self, count: int):
        self.count, self.before = count, torch.get_num_threads()

    def __enter__(self):
        torch.set_num_threads(self.count)

    def __exit__(self, *_):
        torch.set_num_threads(self.before)


def test_tiles_are_used_only_where_the_cpu_has_avx2(monkeypatch):
    monkeypatch.setattr(affine_tiles, "host_features", lambda: "+avx,+fma,-avx2")
    assert not affine_tiles.tiled(4, affine_tiles.WIDTH, "affine4")
    monkeypatch.setattr(affine_tiles, "host_features", lambda: "+avx,+avx2,+fma")
    assert affine_tiles.tiled(4, affine_tiles.WIDTH, "affine4") and not affine_tiles.tiled(4, 16, "affine4")
    assert not affine_tiles.tiled(4, affine_tiles.WIDTH, "scaled8")
    assert not affine_tiles.tiled(2, affine_tiles.WIDTH, "affine4")  # two rows stay on the LLVM kernel
