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
import math

import numba
import numpy as np
import torch

from . import amx_int8, amx_kernel, streamed_gemm
from .affine_kernel import AFFINE_BLOCK, RECORD_FLOATS
from .streamed_gemm import StreamedWeight

LEVELS = 15  # the largest 4-bit code: a Q4_1 block's maximum weight has code 15 (its minimum code 0)
SIGNED_LEVELS = 127  # the largest 8-bit code of a Q8_0 block (its codes run -127…127)
HALF_INFINITY = 0x7C00  # float16 +inf's bits
PROBE_ROWS = 64  # rows checked first, so a matrix without the form (an LM head of 28M weights) is refused quickly


def affine_form(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(d [N, K/32], m [N, K/32], q [N, K] uint8) with weight == fma(q, d, m) bit for bit, every q in 0…15, or None
    when the float32 weight [N, K] has no such form (or K is not a multiple of 32)."""
    return _checked(weight, _blocks_form)


def may_have_form(weight: torch.Tensor) -> bool:
    """Whether the first PROBE_ROWS rows of the float32 weight have an exact 4-bit or 8-bit block form, where the
    kernels build (a quick test: `pack_stacked` checks every row, and a later row may still lack the form)."""
    probe = weight.detach()[:PROBE_ROWS]
    return affine_available() and (affine_form(probe) is not None or scaled_form(probe) is not None)


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
    found = _search(weight, True)
    if found is None:
        return None
    scales, offsets, codes = found
    return scales, offsets, codes.view(torch.uint8)


def _search(weight: torch.Tensor, affine: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(d [N, K/32], m [N, K/32], q [N, K] int8) per block of 32 along the rows of the float32 weight [N, K], from
    one compiled pass over it (`_find_blocks`): `affine` asks for fma(q, d, m) with m the block's minimum and q in
    0…15, else for d · q with q in -127…127 (m = 0). None when some block has no such form or a value is not finite.
    The default model's 210 layer weights are searched in ~0.3 s on the 2-core AVX2 machine, against ~0.55 s with
    the block ranges and scale candidates as tensor operations around a compiled fit (~1.5 s as tensor operations
    alone)."""
    n, k = weight.shape
    values = weight.detach().contiguous().reshape(-1, AFFINE_BLOCK).numpy()
    scales, offsets = np.empty(len(values), np.float32), np.empty(len(values), np.float32)
    codes = np.empty(values.shape, np.int8)
    if not _find_blocks(values, affine, scales, offsets, codes):
        return None
    return (torch.from_numpy(scales).reshape(n, -1), torch.from_numpy(offsets).reshape(n, -1),
            torch.from_numpy(codes).reshape(n, k))


@numba.njit(cache=True, nogil=True, parallel=True)
def _find_blocks(values, affine, scales, offsets, codes):  # pragma: no cover - compiled
    """For every block b of values [n, 32] (float32, in parallel): its offset m (the minimum when `affine`, else 0)
    and the first scale d of `_candidates` of its exact scale ((max - m) / 15, or max |v| / 127) with which each
    value equals m + q·d rounded once, bit for bit (`_block_fits`) — scales[b] = d, offsets[b] = m and codes[b]
    the q. Whether every block found one (False as well for a block holding an infinity or a NaN: the range of an
    infinite block is not finite, and a NaN is never rebuilt)."""
    misses = 0
    levels = np.float32(LEVELS if affine else SIGNED_LEVELS)
    low = np.float32(0.0) if affine else -levels
    for b in numba.prange(values.shape[0]):
        block = values[b]
        least, most, top = block[0], block[0], np.float32(0.0)
        for v in block:
            least, most, top = min(least, v), max(most, v), max(top, abs(v))
        base = least if affine else np.float32(0.0)
        exact = (np.float64(most) - np.float64(least) if affine else np.float64(top)) / np.float64(levels)
        found = False
        if np.isfinite(exact):
            for d in _candidates(exact):
                if _block_fits(block, d, base, low, levels, codes[b]):
                    scales[b], offsets[b], found = d, base, True
                    break
        if not found:
            misses += 1
    return misses == 0


@numba.njit(cache=True, nogil=True)
def _candidates(exact):  # pragma: no cover - compiled
    """The scales tried for a block whose exact scale is `exact` (float64, >= 0), as float32: the float16 nearest it
    (rounded through float32 first, as torch converts float64 to float16), then that float16's neighbours above and
    towards zero — float16 values only, so that d·q is exact for 8-bit codes."""
    bits = _half_bits(np.float32(exact))
    return _half_value(bits), _half_value(min(bits + 1, HALF_INFINITY)), _half_value(max(bits - 1, 0))


@numba.njit(cache=True, nogil=True)
def _half_bits(value):  # pragma: no cover - compiled
    """The bits of the float16 nearest the float32 `value` >= 0 (ties to even; +inf past float16's range)."""
    x = np.float64(value)
    if x >= 65520.0:  # halfway from float16's largest, 65504, to 65536: ties to even round up, past the range
        return HALF_INFINITY
    if x < 2.0 ** -14:  # subnormal: multiples of 2^-24 (1024 of them is the smallest normal's bits too)
        return int(np.rint(x * 2.0 ** 24))
    exponent = math.frexp(x)[1] - 1  # x in [2^e, 2^(e+1))
    steps = int(np.rint(math.ldexp(x, 10 - exponent)))  # 1024…2048: x in units of the float16 spacing there
    return ((exponent + 15) << 10) + steps - 1024  # 2048 steps carry into the exponent


@numba.njit(cache=True, nogil=True)
def _half_value(bits):  # pragma: no cover - compiled
    """The float16 with `bits` (0 … +inf) as a float32."""
    if bits >= HALF_INFINITY:
        return np.float32(np.inf)
    if bits < 1024:
        return np.float32(math.ldexp(bits, -24))
    return np.float32(math.ldexp((bits & 1023) + 1024, (bits >> 10) - 25))


@numba.njit(cache=True, nogil=True, inline="always")
def _block_fits(block, d, base, low, high, codes):  # pragma: no cover - compiled
    """Whether every value of `block` is base + q·d rounded once (float32, sign of zero included), writing the q:
    q = rint((value − base) / d) clamped to [low, high], 0 where d is not positive. Every value is tried (no early
    exit), so the loop runs on vectors."""
    misses = 0
    if d > 0:
        for i in range(block.shape[0]):
            q = min(max(np.rint((block[i] - base) / d), low), high)
            misses += _misses(base + q * d, block[i])
            codes[i] = q
    else:
        for i in range(block.shape[0]):
            misses += _misses(base + np.float32(0.0) * d, block[i])  # d·0 may be +0 where base is -0
            codes[i] = 0
    return misses == 0


@numba.njit(cache=True, nogil=True, inline="always")
def _misses(rebuilt, value):  # pragma: no cover - compiled
    """0 when `rebuilt` is `value` bit for bit (the sign of zero included), else 1."""
    return int((rebuilt != value) | (np.signbit(rebuilt) != np.signbit(value)))


def scaled_form(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(d [N, K/32], q [N, K] int8) with weight == d · q bit for bit, or None when the float32 weight [N, K] has no
    such form (or K is not a multiple of 32): GGUF's Q8_0 expanded to float32 (the default model's LM head)."""
    return _checked(weight, _scaled_blocks)


def _scaled_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`scaled_form` of every row: d the float16 nearest max |w| / 127 or one of its two float16 neighbours, the
    first that rebuilds the whole block."""
    found = _search(weight, False)
    return None if found is None else (found[0], found[2])


def pack_stacked(weights: list[torch.Tensor], bias: torch.Tensor | None = None, amx: bool = True) -> StreamedWeight:
    """The streamed kernel's weight for fp32 weights [N_i, K] stacked by rows: "affine4" panels when every weight
    has the exact 4-bit form ("affine4h" with AVX-512 when float16 holds every block's scale and offset, as GGUF's
    do; with `amx` on a CPU with AMX, "amx4" records for `amx_kernel` then, where K is a multiple of 64), else
    "scaled8" when every one has the exact 8-bit form (where the kernels build here; with `amx` on a CPU with
    AMX-INT8, "amx8" records for `amx_int8` then, where K is a multiple of 64), else
    `streamed_gemm.pack_stacked`'s float32 panels."""
    bias = None if bias is None else bias.detach().contiguous()
    if affine_available():
        forms = [affine_form(weight) for weight in weights]
        if all(form is not None for form in forms):
            scales, offsets, codes = (torch.cat(parts) for parts in zip(*forms))
            if streamed_gemm.vector_width() == 16 and half_exact(scales) and half_exact(offsets):
                if amx and amx_kernel.available() and amx_kernel.fits(codes.shape[1]):
                    return StreamedWeight(amx_kernel.records(scales, offsets, codes), len(codes), bias,
                                          kind=amx_kernel.KIND)
                return StreamedWeight(_half_affine_panels(scales, offsets, codes), len(codes), bias, kind="affine4h")
            return StreamedWeight(_affine_panels(scales, offsets, codes), len(codes), bias, kind="affine4")
        forms = [scaled_form(weight) for weight in weights]
        if all(form is not None for form in forms):
            scales, codes = (torch.cat(parts) for parts in zip(*forms))
            if amx and amx_int8.available() and amx_int8.fits(codes.shape[1]):
                return StreamedWeight(amx_int8.records(scales, codes), len(codes), bias, kind=amx_int8.KIND)
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
