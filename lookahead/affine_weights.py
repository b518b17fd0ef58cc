"""Weights held in their exact 4-bit form: the same float32 values, a sixth of the bytes to stream per step.

A one-row step streams every weight of the model from memory (the default model: 424 MB of float32 per step, ~28
ms on a 2-core AVX2 machine), so its time is the time to read them. Models that come from a GGUF file quantized
as Q4_0 or Q4_1 (the default model is Q4_1) hold float32 weights that are, by construction, `d · q + m` rounded
once: per block of 32 weights along a row, a scale d and an offset m (GGUF stores them as float16) and 4-bit codes
q. transformers expands them to float32 on load; this module finds that form again in the float32 values and keeps
it, checked bit for bit, so the streamed kernel (`streamed_gemm.affine_kernel_ir`) rebuilds each weight in
registers and does the very multiply-adds it does on the float32 weights: every product is bit-identical, from
0.75 bytes per weight instead of 4.

Nothing is assumed: a weight matrix gets this form only when every one of its weights equals `fma(q, d, m)` for
the recovered d, m and q, compared as bit patterns; one weight that does not (any model trained or stored in
float32 or bfloat16) leaves the whole matrix on float32 panels.
"""

from __future__ import annotations

import functools

import torch

from . import streamed_gemm
from .affine_kernel import AFFINE_BLOCK
from .streamed_gemm import StreamedWeight

LEVELS = 15  # the largest 4-bit code: a Q4_1 block's maximum weight has code 15 (its minimum code 0)
PROBE_ROWS = 64  # rows checked first, so a matrix without the form (an LM head of 28M weights) is refused quickly


def affine_form(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(d [N, K/32], m [N, K/32], q [N, K] uint8) with weight == fma(q, d, m) bit for bit, every q in 0…15, or None
    when the float32 weight [N, K] has no such form (or K is not a multiple of 32)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % AFFINE_BLOCK or not weight.numel():
        return None
    source = weight.detach()
    if _blocks_form(source[:PROBE_ROWS]) is None:
        return None
    return _blocks_form(source)


def _blocks_form(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`affine_form` of every row of `weight`: m is each block's minimum, d the float16 nearest (max - m) / 15 or
    one of its two float16 neighbours or that quotient in float32, the first that rebuilds the whole block."""
    n, k = weight.shape
    values = weight.reshape(n, k // AFFINE_BLOCK, AFFINE_BLOCK)
    low, high = values.amin(-1, keepdim=True), values.amax(-1, keepdim=True)
    if not bool(torch.isfinite(low).all() and torch.isfinite(high).all()):
        return None
    exact = (high.double() - low.double()) / LEVELS
    half = exact.to(torch.float16)
    found = torch.zeros(low.shape, dtype=torch.bool)
    scale, codes = torch.zeros_like(low), torch.zeros(values.shape, dtype=torch.uint8)
    for candidate in (half.float(), torch.nextafter(half, half.new_full((), float("inf"))).float(),
                      torch.nextafter(half, half.new_zeros(())).float(), exact.float()):
        q = torch.where(candidate > 0, (values - low) / torch.where(candidate > 0, candidate, 1.0), 0.0)
        q = q.round().clamp(0, LEVELS)
        rebuilt = torch.addcmul(low, q, candidate)  # d·q is exact, so this is fma(q, d, m)
        fits = (rebuilt.view(torch.int32) == values.view(torch.int32)).all(-1, keepdim=True) & ~found
        scale = torch.where(fits, candidate, scale)
        codes = torch.where(fits, q.to(torch.uint8), codes)
        found |= fits
    if not bool(found.all()):
        return None
    return scale[..., 0], low[..., 0], codes.reshape(n, k)


def pack_stacked(weights: list[torch.Tensor], bias: torch.Tensor | None = None) -> StreamedWeight:
    """The streamed kernel's weight for fp32 weights [N_i, K] stacked by rows: "affine4" panels when every weight
    has the exact 4-bit form and the kernel builds here, else `streamed_gemm.pack_stacked`'s float32 panels."""
    forms = [affine_form(weight) for weight in weights] if affine_available() else [None]
    if any(form is None for form in forms):
        return streamed_gemm.pack_stacked(weights, bias)
    scales, offsets, codes = (torch.cat(parts) for parts in zip(*forms))
    return StreamedWeight(_affine_panels(scales, offsets, codes), len(codes),
                          None if bias is None else bias.detach().contiguous(), kind="affine4")


def _affine_panels(scales: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """int32 panels [N_pad / P, K / 32, 6, P] in `streamed_gemm.affine_kernel_ir`'s record layout (padding columns
    zero: d = m = q = 0 rebuild 0)."""
    width = streamed_gemm.vector_width()
    n, k = codes.shape
    pad = -n % width
    blocks, records = (n + pad) // width, k // AFFINE_BLOCK
    scales, offsets = (torch.cat([t, t.new_zeros(pad, records)]) for t in (scales, offsets))
    codes = torch.cat([codes, codes.new_zeros(pad, k)]).to(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)  # step 8g + i in bits 4i … 4i + 3
    lanes = (codes.reshape(n + pad, records, 4, 8) << shifts).sum(-1, dtype=torch.int32)  # [N_pad, records, 4]
    panels = torch.empty(blocks, records, 6, width, dtype=torch.int32)
    panels[:, :, 0] = scales.reshape(blocks, width, records).transpose(1, 2).view(torch.int32)
    panels[:, :, 1] = offsets.reshape(blocks, width, records).transpose(1, 2).view(torch.int32)
    panels[:, :, 2:] = lanes.reshape(blocks, width, records, 4).permute(0, 2, 3, 1)
    return panels


@functools.cache
def affine_available() -> bool:
    """Whether the streamed kernel is available and its "affine4" module builds and computes the float32 kernel's
    very bits on a small case (checked once per process)."""
    if not streamed_gemm.available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        codes = torch.randint(0, LEVELS + 1, (2 * streamed_gemm.vector_width() + 3, 2 * AFFINE_BLOCK),
                              generator=generator, dtype=torch.uint8)
        scales = torch.rand(codes.shape[0], 2, generator=generator).half().float()
        offsets = -torch.rand(codes.shape[0], 2, generator=generator).half().float()
        weight = torch.addcmul(offsets.repeat_interleave(AFFINE_BLOCK, 1), codes.float(),
                               scales.repeat_interleave(AFFINE_BLOCK, 1))
        x = torch.randn(streamed_gemm.rows_per_pass() + 3, weight.shape[1], generator=generator)
        packed = StreamedWeight(_affine_panels(scales, offsets, codes), len(codes), None, kind="affine4")
        return torch.equal(streamed_gemm.product(x, packed), streamed_gemm.product(x, streamed_gemm.pack(weight)))
    except Exception:  # noqa: BLE001 — any failure to build or run the kernel means: not available here
        return False
