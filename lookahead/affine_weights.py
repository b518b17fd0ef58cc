"""Weights held in their exact block form: the same float32 values, a fifth of the bytes (or less) to stream.

A one-row step streams every weight of the model from memory (the default model: 424 MB of float32 per step, ~24
ms on a 2-core AVX2 machine), so its time is the time to read them. Models that come from a GGUF file quantized
as Q4_0 or Q4_1 (the default model's layers are Q4_1) hold float32 weights that are, by construction, `d · q + m`
rounded once: per block of 32 weights along a row, a scale d and an offset m (GGUF stores them as float16) and
4-bit codes q; Q8_0 (the default model's LM head) holds `d · q` with 8-bit codes. transformers expands them to
float32 on load; this module finds that form again in the float32 values and keeps it, checked bit for bit, so the
streamed kernel (`affine_kernel`) rebuilds each weight in registers and does the very multiply-adds it does on the
float32 weights: every product is bit-identical, from 0.75 ("affine4") or 1.125 ("scaled8") bytes per weight
instead of 4. With AVX-512, a 4-bit matrix whose every scale and offset float16 holds exactly (a GGUF file's are
float16) keeps them as float16 ("affine4h", 0.625 bytes per weight, GGUF's own size): the kernel widens them to
the same float32 values in registers, so its products are the same bits from a sixth fewer bytes.

Nothing is assumed: a weight matrix gets a form only when every one of its weights equals `fma(q, d, m)` for the
recovered d, m and q, compared as bit patterns, with d a float16 value (at most 11 significant bits, so d · q is
exact for 8-bit codes and the kernel's single rounding is the check's); one weight that does not (any model
trained or stored in float32 or bfloat16) leaves the whole matrix on float32 panels.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from . import streamed_gemm
from .affine_kernel import AFFINE_BLOCK, RECORD_FLOATS
from .streamed_gemm import StreamedWeight

LEVELS = 15  # the largest 4-bit code: a Q4_1 block's maximum weight has code 15 (its minimum code 0)
PROBE_ROWS = 64  # rows checked first, so a matrix without the form (an LM head of 28M weights) is refused quickly


def affine_form(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(d [N, K/32], m [N, K/32], q [N, K] uint8) with weight == fma(q, d, m) bit for bit, every q in 0…15, or None
    when the float32 weight [N, K] has no such form (or K is not a multiple of 32)."""
    return _checked(weight, _blocks_form)


def _checked(weight: torch.Tensor, find):
    """`find(weight)` for a float32 matrix whose width is a multiple of 32, its first PROBE_ROWS rows tried first;
    None for any other weight or when `find` finds no form."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % AFFINE_BLOCK or not weight.numel():
        return None
    source = weight.detach()
    if find(source[:PROBE_ROWS]) is None:
        return None
    return find(source)


def _blocks_form(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`affine_form` of every row of `weight`: m is each block's minimum, d the float16 nearest (max - m) / 15 or
    one of its two float16 neighbours, the first that rebuilds the whole block."""
    n, k = weight.shape
    values = weight.reshape(n, k // AFFINE_BLOCK, AFFINE_BLOCK)
    low, high = values.amin(-1, keepdim=True), values.amax(-1, keepdim=True)
    if not bool(torch.isfinite(low).all() and torch.isfinite(high).all()):
        return None
    found = _first_fit(values, (high.double() - low.double()) / LEVELS, low, (0, LEVELS), torch.uint8)
    if found is None:
        return None
    scale, codes = found
    return scale.reshape(n, -1), low[..., 0], codes.reshape(n, k)


def _first_fit(values: torch.Tensor, exact: torch.Tensor, offset: torch.Tensor, codes_range: tuple[int, int],
               codes_dtype: torch.dtype):
    """(d, q) per block of `values` [N, B, 32] with values == fma(q, d, offset) bit for bit, q in `codes_range` (as
    `codes_dtype`), d the first candidate that fits: float16(exact) or one of its two float16 neighbours (`exact`
    [N, B, 1] in float64) — float16 values only, so that d·q is exact and rounding d·q + offset once is the kernel's
    fma. None when some block has no fitting candidate. The candidates are computed here for every block at once,
    the blocks tried in one compiled pass (`_fit_blocks`: the default model's 210 layer weights in ~0.2 s on the
    2-core AVX2 machine, where the same search as a dozen tensor operations a chunk took ~1.5 s)."""
    values, offset, exact = (t.reshape(-1, *t.shape[2:]) for t in (values, offset, exact))
    half = exact.to(torch.float16)
    candidates = torch.cat([half, torch.nextafter(half, half.new_full((), float("inf"))),
                            torch.nextafter(half, half.new_zeros(()))], dim=1).float()
    scales, codes = torch.empty(len(values), 1), torch.empty(values.shape, dtype=codes_dtype)
    if not _fit_blocks(values.contiguous().numpy(), candidates.numpy(), offset.reshape(-1).contiguous().numpy(),
                       float(codes_range[0]), float(codes_range[1]), scales.numpy(), codes.numpy()):
        return None
    return scales, codes


@numba.njit(cache=True, nogil=True, parallel=True)
def _fit_blocks(values, candidates, offsets, low, high, scales, codes):  # pragma: no cover - compiled
    """For every block b of values [n, 32] (in parallel): the first candidate d of candidates[b] with which each
    value equals offsets[b] + q·d rounded once, bit for bit, for q = rint((value − offset) / d) clamped to [low,
    high] (q = 0 where d is not positive), all in float32 — scales[b, 0] = d and codes[b] = the q. Whether every
    block found one."""
    misses = 0
    for b in numba.prange(values.shape[0]):
        found = False
        for c in range(candidates.shape[1]):
            if _block_fits(values[b], candidates[b, c], offsets[b], low, high, codes[b]):
                scales[b, 0] = candidates[b, c]
                found = True
                break
        if not found:
            misses += 1
    return misses == 0


@numba.njit(cache=True, nogil=True, inline="always")
def _block_fits(block, d, base, low, high, codes):  # pragma: no cover - compiled
    """Whether every value of `block` is base + q·d rounded once (float32, sign of zero included), writing the q."""
    for i in range(block.shape[0]):
        q = np.float32(0.0)
        if d > 0:
            q = np.float32(min(max(np.rint((block[i] - base) / d), low), high))
        rebuilt = base + q * d
        if rebuilt != block[i] or np.signbit(rebuilt) != np.signbit(block[i]):
            return False
        codes[i] = q
    return True


def scaled_form(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(d [N, K/32], q [N, K] int8) with weight == d · q bit for bit, or None when the float32 weight [N, K] has no
    such form (or K is not a multiple of 32): GGUF's Q8_0 expanded to float32 (the default model's LM head)."""
    return _checked(weight, _scaled_blocks)


def _scaled_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`scaled_form` of every row: d the float16 nearest max |w| / 127 or one of its two float16 neighbours, the
    first that rebuilds the whole block."""
    n, k = weight.shape
    values = weight.reshape(n, k // AFFINE_BLOCK, AFFINE_BLOCK)
    top = values.abs().amax(-1, keepdim=True)
    if not bool(torch.isfinite(top).all()):
        return None
    found = _first_fit(values, top.double() / 127, torch.zeros_like(top), (-127, 127), torch.int8)
    if found is None:
        return None
    scale, codes = found
    return scale.reshape(n, -1), codes.reshape(n, k)


def pack_stacked(weights: list[torch.Tensor], bias: torch.Tensor | None = None) -> StreamedWeight:
    """The streamed kernel's weight for fp32 weights [N_i, K] stacked by rows: "affine4" panels when every weight
    has the exact 4-bit form ("affine4h" with AVX-512 when float16 holds every block's scale and offset, as GGUF's
    do), else "scaled8" when every one has the exact 8-bit form (where the kernels build here), else
    `streamed_gemm.pack_stacked`'s float32 panels."""
    bias = None if bias is None else bias.detach().contiguous()
    if affine_available():
        forms = [affine_form(weight) for weight in weights]
        if all(form is not None for form in forms):
            scales, offsets, codes = (torch.cat(parts) for parts in zip(*forms))
            if streamed_gemm.vector_width() == 16 and half_exact(scales) and half_exact(offsets):
                return StreamedWeight(_half_affine_panels(scales, offsets, codes), len(codes), bias, kind="affine4h")
            return StreamedWeight(_affine_panels(scales, offsets, codes), len(codes), bias, kind="affine4")
        forms = [scaled_form(weight) for weight in weights]
        if all(form is not None for form in forms):
            scales, codes = (torch.cat(parts) for parts in zip(*forms))
            return StreamedWeight(_scaled_panels(scales, codes), len(codes), bias, kind="scaled8")
    return streamed_gemm.pack_stacked(weights, bias)


def _affine_panels(scales: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """int32 words [N_pad / P, K / 32, 6, P] in the "affine4" record layout of `affine_kernel` (padding columns
    zero: d = m = q = 0 rebuild 0)."""
    return _four_bit_panels([scales, offsets], codes, RECORD_FLOATS["affine4"])


def _half_affine_panels(scales: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """int32 words [N_pad / P, K / 32, 5, P] in the "affine4h" record layout of `affine_kernel`: the "affine4"
    layout with each column's scale and offset as float16 halves of one word (d low, m high), for scales and
    offsets that float16 holds exactly (`half_exact`)."""
    words = (scales.half().view(torch.int16).to(torch.int32) & 0xFFFF) | (
        offsets.half().view(torch.int16).to(torch.int32) << 16)
    return _four_bit_panels([words], codes, RECORD_FLOATS["affine4h"])


def _four_bit_panels(per_block: list[torch.Tensor], codes: torch.Tensor, words: int) -> torch.Tensor:
    """int32 words [N_pad / P, K / 32, words, P]: `per_block`'s words first (`_records`), then the four code lanes
    of 8 steps each, step 8g + i in bits 4i … 4i + 3 of lane g."""
    panels, codes = _records(per_block, codes, words)
    _code_lanes(codes.contiguous().numpy(), len(per_block), panels.numpy())
    return panels


@numba.njit(cache=True, nogil=True, parallel=True)
def _code_lanes(codes, first, panels):  # pragma: no cover - compiled
    """panels[b, r, first + g, j] = the codes of column b·P + j at steps 32r + 8g … 32r + 8g + 7, step 8g + i in
    bits 4i … 4i + 3, for codes [N_pad, K] (uint8, each < 16) and panels [N_pad / P, K / 32, words, P] (int32)."""
    blocks, records, _, width = panels.shape
    for b in numba.prange(blocks):
        for j in range(width):
            row = codes[b * width + j]
            for r in range(records):
                for g in range(4):
                    lane = 0
                    for i in range(8):
                        lane |= np.int32(row[32 * r + 8 * g + i]) << (4 * i)
                    panels[b, r, first + g, j] = lane


def half_exact(values: torch.Tensor) -> bool:
    """Whether float16 holds every float32 value exactly (bit for bit back, the sign of zero included)."""
    return torch.equal(values.half().float().view(torch.int32), values.view(torch.int32))


def _scaled_panels(scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """int32 words [N_pad / P, K / 32, 9, P] in the "scaled8" record layout of `affine_kernel` (padding zero)."""
    panels, codes = _records([scales], codes, RECORD_FLOATS["scaled8"])
    blocks, records, _, width = panels.shape
    steps = codes.reshape(blocks, width, records, AFFINE_BLOCK).permute(0, 2, 3, 1).contiguous()  # [.., 32, P]
    panels[:, :, 1:] = steps.view(torch.int32).reshape(blocks, records, 8, width)
    return panels


def _records(per_block: list[torch.Tensor], codes: torch.Tensor, words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 panels [N_pad / P, K / 32, words, P] whose first words hold `per_block`'s 32-bit values [N, K / 32]
    (float32, or int32 words) as one word per column — the rest left for the codes —, `codes` [N, K] padded with zero
    rows to N_pad)."""
    width = streamed_gemm.vector_width()
    n, k = codes.shape
    pad, records = -n % width, k // AFFINE_BLOCK
    blocks = (n + pad) // width
    panels = torch.empty(blocks, records, words, width, dtype=torch.int32)
    for word, values in enumerate(per_block):
        padded = torch.cat([values, values.new_zeros(pad, records)])
        panels[:, :, word] = padded.reshape(blocks, width, records).transpose(1, 2).view(torch.int32)
    return panels, torch.cat([codes, codes.new_zeros(pad, k)])


@functools.cache
def affine_available() -> bool:
    """Whether the streamed kernel is available and its "affine4", "scaled8" (and, with AVX-512, "affine4h") modules
    build and compute the float32 kernel's very bits on a small case (checked once per process)."""
    if not streamed_gemm.available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        n, k = 2 * streamed_gemm.vector_width() + 3, 2 * AFFINE_BLOCK
        codes = torch.randint(0, LEVELS + 1, (n, k), generator=generator, dtype=torch.uint8)
        signed = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
        scales = torch.rand(n, 2, generator=generator).half().float()
        offsets = -torch.rand(n, 2, generator=generator).half().float()
        x = torch.randn(streamed_gemm.rows_per_pass() + 3, k, generator=generator)
        cases = ((_affine_panels(scales, offsets, codes), "affine4", _expand(scales, codes, offsets)),
                 (_scaled_panels(scales, signed), "scaled8", _expand(scales, signed, torch.zeros_like(scales))))
        if streamed_gemm.vector_width() == 16:
            cases += ((_half_affine_panels(scales, offsets, codes), "affine4h", _expand(scales, codes, offsets)),)
        return all(torch.equal(streamed_gemm.product(x, StreamedWeight(panels, n, None, kind=kind)),
                               streamed_gemm.product(x, streamed_gemm.pack(weight))) for panels, kind, weight in cases)
    except Exception:  # noqa: BLE001 — any failure to build or run the kernels means: not available here
        return False


def _expand(scales: torch.Tensor, codes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The float32 weight fma(q, d, m) of per-block scales and offsets [N, K/32] and codes [N, K]."""
    return torch.addcmul(offsets.repeat_interleave(AFFINE_BLOCK, 1), codes.float(),
                         scales.repeat_interleave(AFFINE_BLOCK, 1))
