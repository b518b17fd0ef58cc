"""Greedy logits from a quarter of the LM head's bytes: int8 weights, a proven error bound, fp32 where it matters.

A one-row step of the default model streams 540 MB of fp32 weights; the LM head (49152 × 576, tied to the
embeddings) is 113 MB of it. Greedy verification reads one thing from a row's logits: its argmax. So within
`argmax_logits(model)` the LM head computes every row from int8 copies of its weights (one scale per vocabulary
row, `streamed_gemm.quantize`) together with, per token v, a bound b_v on how far that approximation a_v can be
from the logit l_v the fp32 LM head computes:

    |l_v − a_v| ≤ ‖h‖₂ · (e_v + γ_K (s_v ‖q_v‖₂ + ‖w_v‖₂)) = b_v,

where h is the row's input, w_v the fp32 weight row, s_v · q_v its int8 rounding, e_v = ‖s_v q_v − w_v‖₂ (computed
once, in float64), and γ_K = K·u / (1 − K·u) (u = 2⁻²⁴) bounds the rounding of a K-term chain of fused
multiply-adds, which is how both kernels sum (Cauchy–Schwarz turns the elementwise bounds into norms). a_v is
formed in float64 from the kernel's float32 sum, so no rounding of it enters; the slack is then inflated by 1%
and 2⁻²²·|a_v| is added, which covers the float64 arithmetic of the bound and the float32 rounding of a_v.

Any token whose upper bound a_v + b_v falls below the best lower bound max_u (a_u − b_u) cannot be the argmax;
the few that remain (the default model: 3 per row in the median, 23 at most over a measured generation)
get their exact logits from the fp32 streamed kernel on just their weight rows — the same multiply-adds in the
same order as the full fp32 product, so the same numbers bit for bit. Every other token keeps its approximation
a_v rounded to float32, at most 2⁻²⁴|a_v| above a_v, so below a_v + b_v < max_u (a_u − b_u) ≤ the winner's exact
logit: strictly below it. The argmax of every row is therefore exactly the argmax of the fp32 logits, ties
included (all tokens tied at the maximum are candidates, and the lowest index wins as before); the other values
are the int8 head's, good enough for drafting (the recycling table reads their top-k) but not logits: sampling,
logits processors, returned scores and log-probabilities never run inside the block (`hf.py` decides).

Only model classes whose logits are the LM head's output unchanged qualify (no scaling or soft-capping after
it), only an fp32 LM head without bias packed by `packed_linears`, and only products of the row counts the
streamed kernel computes (so the candidates' exact values are those the plain step would compute). A head the
streamed kernel holds in an exact block form (`affine_weights`: GGUF's Q8_0, the default model's head, 1.125 bytes
a weight) runs its own exact product instead: the int8 copy saves no bytes there, and its bound, candidates and
extra passes made it slower (the default model, 2 threads, the Xeon of session 54: 1.34 / 2.75 ms at 1 / 8 rows
against the exact 8-bit head's 0.91 / 2.28; whole generations 1–5% faster without it speculating, 2–8% in
mode off, two A/B runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace

import numba
import numpy as np
import torch
from torch import nn

from . import affine_weights, streamed_gemm
from .packed_linear import PackedLinear

# Causal LM classes whose forward returns `self.lm_head(hidden_states)` as the logits (transformers 5.x).
ELIGIBLE_MODELS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                             "Phi3ForCausalLM", "GemmaForCausalLM", "GPT2LMHeadModel"})
# More candidate tokens than this over a step's rows and the exact fp32 product of the whole head is cheaper.
MAX_CANDIDATES = 4096
_UNIT = 2.0 ** -24  # float32 unit roundoff
_INFLATE = 1.01


@contextlib.contextmanager
def argmax_logits(model: nn.Module, enabled: bool = True) -> Iterator[bool]:
    """Within the block, `model`'s LM head gives exact argmaxes from int8 weights (see the module docstring);
    yields whether it does. Call it inside `packed_linears(model)`, only where nothing but each row's argmax (and
    drafting) reads the logits. The head's own forward is back on exit, also on error."""
    head = model.get_output_embeddings() if enabled else None
    if head is None or not eligible(model, head):
        yield False
        return
    head.forward = ArgmaxForward(head)
    try:
        yield True
    finally:
        del head.forward


def eligible(model: nn.Module, head: nn.Module) -> bool:
    """Whether `head` (`model`'s output embeddings) can compute bounded argmax logits and gains from them: a model
    class that returns the head's output as its logits, an fp32 `PackedLinear` head without bias, with the
    streamed kernel built, whose streamed weight is float32 (not in an exact block form: module docstring)."""
    return (type(model).__name__ in ELIGIBLE_MODELS and isinstance(head, PackedLinear) and head.bias is None
            and head.weight.dtype == torch.float32 and head.weight.device.type == "cpu"
            and "forward" not in head.__dict__ and streamed_gemm.available() and not compact_head(head))


def compact_head(head: PackedLinear) -> bool:
    """Whether the streamed kernel holds `head`'s weight in an exact block form (`affine_weights`; built here when
    the first rows have one, as the head's own product would build it)."""
    packed = head.packed
    return (packed.compact and affine_weights.may_have_form(head.weight)
            and packed.streamed().kind != "float32")


class ArgmaxForward:
    """The forward installed on the LM head inside `argmax_logits`: bounded logits for the row counts the streamed
    kernel computes, the head's own forward for everything else."""

    def __init__(self, head: PackedLinear):
        self.head = head
        self.own_forward = type(head).forward.__get__(head)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Logits `[..., V]` for `x` `[..., K]` whose argmax over the last dimension is exactly the fp32 head's."""
        packed = self.head.packed
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if (x.dtype != torch.float32 or x.requires_grad or not packed.default_rows < rows <= packed.streamed_rows):
            return self.own_forward(x)
        out = bounded_head(self.head).logits(x.reshape(rows, x.shape[-1]), self.own_forward)
        return out.view(*x.shape[:-1], out.shape[-1])


def bounded_head(head: PackedLinear) -> "BoundedHead":
    """The `BoundedHead` of `head`'s current weight: built on first use (~0.1 s for the default model) and kept
    with the head's other packed layouts, which rebuild it when the weight changed in place or was replaced."""
    return head.packed.derived("bounded-int8", lambda: BoundedHead(head.weight.detach()))


class BoundedHead:
    """An fp32 LM head weight [V, K] with its int8 copy and per-token slack: `logits(x)` as the module docstring
    describes."""

    def __init__(self, weight: torch.Tensor):
        problem = f"a bounded head needs a finite 2-D float32 weight, got {weight.dtype} {tuple(weight.shape)}"
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(problem)
        self.weight = weight
        quantized = streamed_gemm.quantize(weight)
        self.slack = slack(weight, quantized.scales).numpy()
        if not np.isfinite(self.slack).all():  # a non-finite weight makes its row's slack non-finite
            raise ValueError(problem)
        self.scales = quantized.scales.numpy()
        self.sums = replace(quantized, scales=None)  # the kernel's unscaled sums; scaled in float64 below

    def logits(self, x: torch.Tensor, exact: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """[M, V] for x [M, K]: exact fp32 logits for every token that could be its row's argmax, the int8
        approximation (below the row's maximum) for every other token (see the module docstring). `exact(x)`,
        the fp32 head, computes them all instead when x is not finite or too many tokens remain."""
        norms = torch.linalg.vector_norm(x.double(), dim=1)
        if not bool(torch.isfinite(norms).all()):
            return exact(x)
        sums = streamed_gemm.product(x, self.sums).numpy()
        out, best = torch.empty(sums.shape, dtype=torch.float32), np.empty(sums.shape[0])
        _approximations(sums, self.scales, self.slack, norms.numpy(), out.numpy(), best)
        reach = np.empty(sums.shape, dtype=np.bool_)
        _reaching(sums, self.scales, self.slack, norms.numpy(), best, reach)
        tokens = np.flatnonzero(reach.any(axis=0) if len(reach) > 1 else reach[0])
        if len(tokens) > MAX_CANDIDATES:
            return exact(x)
        out[:, torch.from_numpy(tokens)] = streamed_gemm.product(x, streamed_gemm.pack_rows(self.weight, tokens))
        return out


def slack(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per token v, float64 [V]: 1.01 · (e_v + γ_K (s_v ‖q_v‖₂ + ‖w_v‖₂)) for the fp32 rows `weight` [V, K] and
    their int8 rounding q_v = round(w_v / s_v) with `scales` s [V] (as `streamed_gemm.quantize` rounds them)."""
    k = weight.shape[1]
    out = np.empty(weight.shape[0])
    _slack_rows(weight.detach().contiguous().numpy(), scales.contiguous().numpy(), k * _UNIT / (1 - k * _UNIT),
                _INFLATE, out)
    return torch.from_numpy(out)


@numba.njit(cache=True, nogil=True, parallel=True)
def _slack_rows(weight, scales, gamma, inflate, out):  # pragma: no cover - compiled
    """out[v] = inflate · (‖s_v q_v − w_v‖₂ + gamma (‖s_v q_v‖₂ + ‖w_v‖₂)) in float64, rows in parallel, with q_v
    rounded as `streamed_gemm.quantize` rounds it (float32 division, halves to even, clamped to ±127)."""
    for v in numba.prange(weight.shape[0]):
        scale = scales[v]
        error = size_q = size_w = 0.0
        for k in range(weight.shape[1]):
            q = min(max(np.rint(weight[v, k] / scale), np.float32(-127.0)), np.float32(127.0))
            exact, rounded = np.float64(weight[v, k]), np.float64(q) * np.float64(scale)
            error += (rounded - exact) ** 2
            size_q += rounded ** 2
            size_w += exact ** 2
        out[v] = inflate * (np.sqrt(error) + gamma * (np.sqrt(size_q) + np.sqrt(size_w)))


@numba.njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _approximations(sums, scales, slack, norms, out, best):  # pragma: no cover - compiled
    """For each row m (rows in parallel): a_v = sums[m, v] · scales[v] and b_v = norms[m] · slack[v] + 2⁻²²|a_v|
    in float64 (the float32 product is exact there); out[m, v] = the float32 product (a_v rounded to nearest: within
    2⁻²⁴|a_v| of it, which the 2⁻²² term covers); best[m] = max_v (a_v − b_v). (fastmath lets the loop vectorize;
    any reassociation or contraction it allows moves these float64 numbers by ~1e-16 of their size, far inside
    the margins of the bound.)"""
    rows, vocab = sums.shape
    for m in numba.prange(rows):
        top = -np.inf
        for v in range(vocab):
            a = np.float64(sums[m, v]) * np.float64(scales[v])
            out[m, v] = sums[m, v] * scales[v]
            top = max(top, a - (norms[m] * slack[v] + abs(a) * 2.0 ** -22))
        best[m] = top


@numba.njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _reaching(sums, scales, slack, norms, best, reach):  # pragma: no cover - compiled
    """reach[m, v] = whether token v's upper bound a_v + b_v in row m reaches best[m] (rows in parallel)."""
    rows, vocab = sums.shape
    for m in numba.prange(rows):
        for v in range(vocab):
            a = np.float64(sums[m, v]) * np.float64(scales[v])
            reach[m, v] = a + (norms[m] * slack[v] + abs(a) * 2.0 ** -22) >= best[m]
