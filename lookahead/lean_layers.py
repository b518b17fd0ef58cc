"""Llama-style decoder layers without transformers' per-module overhead, computing the very same numbers.

A one-row step of the default model spends about a seventh of its time around its 30 decoder layers rather than in
them: module calls, the slicing copies of the stacked q/k/v and gate/up products, RoPE applied to queries and keys
one after the other. `lean_layers(model)` gives every Llama-style decoder layer (Llama, Qwen2, Mistral) whose
q/k/v and gate/up products are prepacked as one (`packed_linear.FusedGroup`) a forward that calls the same
products, norms, RoPE, cache and attention function directly: one call per stacked product read through views
instead of copied slices (except the MLP's gate half, copied as the layer's own forward copies it: the activation's
rounding depends on its input's layout) — or, where the products are computed one by one anyway (a prefill on the
layers' own weights), their outputs apart, never concatenated —, RoPE on queries and keys as one tensor (or the two
apart, element by element the same) with `rotate_half`'s sign folded into the sin once per forward, the RMS norm
in a third of `torch.rms_norm`'s operations (`LeanNorm`: transformers' own arithmetic, with no Python numbers to
convert). Each dispatched operation costs tens of microseconds here, as every layer's weights stream through the
caches and evict the dispatcher's working set (`benchmarks/bench_dispatch.py`): fewer operations, the same
arithmetic. Every operation is the one transformers' layer performs, element for element, so the logits are
bit-identical (tests check it on every supported architecture and the default model).

A call the lean forward does not handle (gradients, a dtype other than fp32, a layer in training mode, attention
weights asked for) runs the layer's own forward. Layers of other architectures, layers whose products are not
packed, and layers that already carry a forward of their own (e.g. accelerate's offloading hooks) are left alone.

With `fused` (as generation runs them), a step whose products all run on the streamed kernel runs each layer as one
compiled call instead (`fused_layer.py`): the same products, the norms, attention and SiLU in their own order, so
those steps' logits equal this forward's in all but the last bits. So do a prompt's: with `fused`, the norms, RoPE
and SiLU gating of a forward of one sequence of at least `prefill_kernels.ROWS` rows run as compiled passes split
between the threads (`prefill_kernels.py`; RoPE and the residual adds the same bits, the norms' sums and SiLU's exp
their own).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import fused_stack, prefill_kernels
from .compat import CACHE_KWARG, pop_cache
from .fused_layer import FusedLayer
from .packed_linear import FusedMember, PackedLinear, _linear, linear_parts
from .rope_table import fold_sin

_ON_ATTR = "_lookahead_lean_on"

# Decoder layer classes whose forward is the Llama formula, and how each passes a sliding window to its attention.
_SLIDING_WINDOW: dict[str, Callable[[nn.Module], int | None] | None] = {
    "LlamaDecoderLayer": None,
    "Qwen2DecoderLayer": lambda attn: attn.sliding_window,
    "MistralDecoderLayer": lambda attn: getattr(attn.config, "sliding_window", None),
}


@contextlib.contextmanager
def lean_layers(model: nn.Module, enabled: bool = True, fused: bool = True) -> Iterator[int]:
    """Within the block, every supported decoder layer of `model` runs the lean forward; yields how many layers do
    (0 when disabled or none is supported). Call it inside `packed_linears(model)`: only layers with packed,
    stacked products qualify. `fused`: steps whose products all run on the streamed kernel run each layer as one
    compiled call (`fused_layer.py`). The layers' own forwards are back on exit, also on error; not re-entrant."""
    if not enabled or getattr(model, _ON_ATTR, False):
        yield 0
        return
    layers = [layer for layer in model.modules() if _supported(layer)]
    rotary = FoldedRotary()  # one forward's cos and sin serve every layer
    for layer in layers:
        layer.forward = LeanForward(layer, rotary, fused)
    stacks = [stack for stack in model.modules() if _install_stack(stack, rotary)] if fused else []
    setattr(model, _ON_ATTR, True)
    try:
        yield len(layers)
    finally:
        for stack in stacks:
            fused_stack.remove(stack)
        for layer in layers:
            del layer.forward
        setattr(model, _ON_ATTR, False)


def _install_stack(module: nn.Module, rotary: "FoldedRotary") -> bool:
    """Run `module`'s forward as one compiled call (`fused_stack`) if it holds decoder layers that all fuse."""
    layers = getattr(module, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not layers:
        return False
    forwards = [layer.__dict__.get("forward") for layer in layers]
    if not all(isinstance(f, LeanForward) for f in forwards):
        return False
    return fused_stack.install(module, [f.fused for f in forwards],
                               [f.window_kwargs.get("sliding_window") for f in forwards], rotary,
                               _lean_norm(getattr(module, "norm", None)))


def _lean_norm(norm) -> "LeanNorm | None":
    """A `LeanNorm` of `norm` where it computes `norm`'s own output bit for bit (an RMS norm with its class's own
    forward), else None."""
    if not isinstance(norm, nn.Module) or "forward" in norm.__dict__ or not type(norm).__name__.endswith("RMSNorm"):
        return None
    return LeanNorm(norm) if _computes_like(norm) else None


def _supported(layer: nn.Module) -> bool:
    """A decoder layer of a supported class, its q/k/v and gate/up stacked in packed groups, its own forward."""
    if type(layer).__name__ not in _SLIDING_WINDOW or "forward" in layer.__dict__:
        return False
    if not _standard_rotate_half(getattr(sys.modules[type(layer).__module__], "rotate_half", None)):
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    return (_stacked(attn.q_proj, attn.k_proj, attn.v_proj) and _stacked(mlp.gate_proj, mlp.up_proj)
            and all(type(norm).__name__.endswith("RMSNorm") and _computes_like(norm)
                    for norm in (layer.input_layernorm, layer.post_attention_layernorm)))


def _stacked(*members: nn.Module) -> bool:
    """Whether `members` are, in order, the whole of one packed `FusedGroup`."""
    if not all(isinstance(m, FusedMember) for m in members):
        return False
    group = members[0].group
    return (len(group.linears) == len(members)
            and all(m.group is group and m.index == i for i, m in enumerate(members)))


class LeanForward:
    """The lean forward of one decoder layer (installed as the layer's `forward`; see the module docstring)."""

    def __init__(self, layer: nn.Module, rotary: "FoldedRotary", fused: bool = False):
        self.layer, self.rotary = layer, rotary
        self.input_norm, self.post_norm = LeanNorm(layer.input_layernorm), LeanNorm(layer.post_attention_layernorm)
        attn, mlp = layer.self_attn, layer.mlp
        self.own_forward = type(layer).forward.__get__(layer)
        self.head_dim = attn.head_dim
        self.query_heads = attn.q_proj.out_features // attn.head_dim
        self.rotated_heads = (attn.q_proj.out_features + attn.k_proj.out_features) // attn.head_dim
        self.intermediate = mlp.gate_proj.out_features
        self.silu = _is_silu(mlp.act_fn)  # then SiLU runs in place, without a module call
        window = _SLIDING_WINDOW[type(layer).__name__]
        self.window_kwargs = {} if window is None else {"sliding_window": window(attn)}
        modeling = sys.modules[type(attn).__module__]  # the architecture's own helpers, called as its layer does
        self.eager = getattr(modeling, "eager_attention_forward", None)
        self.compiled_prefill = fused  # a prompt's norms, RoPE and SiLU on `prefill_kernels`
        self.fused = None
        if fused and FusedLayer.supports(layer):
            self.fused = FusedLayer(layer, self.head_dim, self.query_heads, self.rotated_heads - self.query_heads,
                                    self.intermediate, (self.input_norm.weight, self.post_norm.weight),
                                    (self.input_norm.eps, self.post_norm.eps))

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, use_cache: bool | None = False,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        """The layer's output for `hidden_states` `[B, T, hidden]`, as the layer's own forward computes it (the
        cache comes in `kwargs` by either of its names, `compat.pop_cache`)."""
        past_key_values = pop_cache(kwargs)
        if not self._handles(hidden_states, position_embeddings, kwargs):
            return self.own_forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=use_cache, position_embeddings=position_embeddings,
                                    **{CACHE_KWARG: past_key_values}, **kwargs)
        if self.fused is not None:
            out = self.fused(hidden_states, attention_mask, past_key_values, *self.rotary(position_embeddings),
                             self.window_kwargs.get("sliding_window"), kwargs)
            if out is not None:
                return out
        compiled = self.compiled_prefill and prefill_kernels.applies(hidden_states)
        normed = (prefill_kernels.rms_norm(hidden_states, self.input_norm.weight, self.input_norm.eps) if compiled
                  else self.input_norm(hidden_states))
        attended = self._attention(normed, attention_mask, position_ids, past_key_values, use_cache,
                                   position_embeddings, kwargs, compiled)
        if compiled:  # attended += hidden_states in place, then the norm, in one pass
            normed = prefill_kernels.add_rms_norm(attended, hidden_states, self.post_norm.weight, self.post_norm.eps)
        else:
            normed = self.post_norm(attended.add_(hidden_states))  # addition commutes exactly
        return self._mlp(normed, compiled).add_(attended)

    def _handles(self, hidden_states: torch.Tensor, position_embeddings, kwargs: dict) -> bool:
        """Whether this call is one the lean forward computes (else the layer's own forward runs)."""
        return (hidden_states.dtype == torch.float32 and not hidden_states.requires_grad
                and not self.layer.training and position_embeddings is not None
                and not kwargs.get("output_attentions"))

    def _attention(self, x: torch.Tensor, attention_mask, position_ids, past_key_values, use_cache,
                   position_embeddings, kwargs: dict, compiled: bool = False) -> torch.Tensor:
        """The self-attention block's output (after o_proj) for the normed input `x` `[B, T, hidden]` (`compiled`:
        RoPE on `prefill_kernels`)."""
        attn = self.layer.self_attn
        query, key, value = self._rotated_heads(x, attn.q_proj.group.packed, self.rotary(position_embeddings),
                                                compiled)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, attn.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, self.eager)
        out, _ = attend(attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling,
                        position_ids=position_ids, use_cache=use_cache, **self.window_kwargs, **kwargs)
        return _project(out.reshape(*x.shape[:2], -1).contiguous(), attn.o_proj)

    def _rotated_heads(self, x: torch.Tensor, packed, factors: tuple[torch.Tensor, torch.Tensor],
                       compiled: bool = False):
        """(query, key, value) `[B, heads, T, D]` of the normed input `x` `[B, T, hidden]`, RoPE applied to query and
        key with `factors` = (cos, folded sin): from the stacked q/k/v product, or from the three products apart
        where `_linear` computes them one by one (a prefill: no concatenation, then the same per-element RoPE);
        `compiled` (one sequence): RoPE on `prefill_kernels`, the same numbers."""
        batch, rows, _ = x.shape
        rope = self._compiled_rope(factors) if compiled else None
        parts = linear_parts(x, packed)
        if parts is not None:
            query, key, value = (part.view(batch, rows, -1, self.head_dim).transpose(1, 2) for part in parts)
            if rope is not None:
                return rope(parts[0], query.shape[1]), rope(parts[1], key.shape[1]), value
            return _rope(query, factors, self.head_dim), _rope(key, factors, self.head_dim), value
        stacked = _linear(x, packed)  # [B, T, q + k + v]
        heads = stacked.view(batch, rows, -1, self.head_dim).transpose(1, 2)  # [B, q + k + v heads, T, D]
        query_key = (rope(stacked, self.rotated_heads) if rope is not None  # q and k at once
                     else _rope(heads[:, :self.rotated_heads], factors, self.head_dim))
        return query_key[:, :self.query_heads], query_key[:, self.query_heads:], heads[:, self.rotated_heads:]

    @staticmethod
    def _compiled_rope(factors: tuple[torch.Tensor, torch.Tensor]):
        """`rope(states, heads)`: `prefill_kernels.rope` of one sequence's states with `factors` [1, 1, T, D]."""
        cos, folded_sin = (factor[0, 0] for factor in factors)
        return lambda states, heads: prefill_kernels.rope(states, heads, cos, folded_sin)

    def _mlp(self, x: torch.Tensor, compiled: bool = False) -> torch.Tensor:
        """The MLP block's output for the normed input `x`: down(act(gate(x)) * up(x)) (`compiled`: SiLU gating on
        `prefill_kernels`)."""
        mlp = self.layer.mlp
        parts = linear_parts(x, mlp.gate_proj.group.packed)  # gate and up apart (a prefill), or None: stacked
        if parts is None:
            gate_up = _linear(x, mlp.gate_proj.group.packed)  # [B, T, 2 × intermediate]
            parts = gate_up[..., :self.intermediate], gate_up[..., self.intermediate:]
        gate, up = parts
        if compiled and self.silu:
            return _project(prefill_kernels.silu_times(gate, up), mlp.down_proj)
        # The activation runs on a contiguous gate (a copy of the stacked product's half), the layout the layer's
        # own forward hands it: CPU kernels round the elements of a vector loop's tail differently (exp, erf), and
        # where the tails fall depends on the layout (and on how the threads split the work). SiLU then runs in
        # place on it.
        gate = gate.contiguous()
        activated = torch.nn.functional.silu(gate, inplace=True) if self.silu else mlp.act_fn(gate)
        return _project(activated * up, mlp.down_proj)


class FoldedRotary:
    """The RoPE factors of one forward, shaped for `[B, heads, T, D]` states and computed once for all its layers:
    `cos` and the sin with its first half negated (where `rotate_half(x) = cat(-x2, x1)` puts its minus sign)."""

    def __init__(self):
        self._source: tuple[torch.Tensor, torch.Tensor] | None = None
        self._factors: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, folded sin), each `[B, 1, T, D]`, for the model's `(cos, sin)` `[B, T, D]`."""
        cos, sin = position_embeddings
        if self._source is None or self._source[0] is not cos or self._source[1] is not sin:
            self._source, self._factors = (cos, sin), (cos.unsqueeze(1), fold_sin(sin).unsqueeze(1))
        return self._factors


@functools.cache
def _standard_rotate_half(rotate_half) -> bool:
    """Whether `rotate_half` is Llama's cat(-x2, x1) (the form `FoldedRotary` folds into the sin); probed once per
    function."""
    if rotate_half is None:
        return False
    probe = torch.arange(1.0, 9.0).view(1, 1, 1, 8)
    return torch.equal(rotate_half(probe), torch.tensor([-5.0, -6.0, -7.0, -8.0, 1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 8))


class LeanNorm:
    """transformers' Llama RMS norm of fp32 `x`, weight · (x · rsqrt(mean(x²) + eps)), in eight dispatched operations
    instead of `torch.rms_norm`'s 24: x · x (what `pow(x, 2)` computes), its sum over the last dimension divided in
    place by the width (how torch's CPU `mean` computes), + eps, rsqrt, two products. The width and eps are float32
    0-dim tensors, which spares converting a Python number at every call; the numbers are the same bit for bit
    (`_computes_like` checks it once per norm class against the module's own forward)."""

    def __init__(self, norm: nn.Module):
        self.weight = norm.weight
        self.width = torch.tensor(float(norm.weight.shape[-1]))
        self.eps = torch.tensor(norm.variance_epsilon, dtype=torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The normed `x` `[..., width]`."""
        variance = (x * x).sum(-1, keepdim=True).div_(self.width).add_(self.eps)
        return x * variance.rsqrt_() * self.weight


_NORM_CHECKED: dict[tuple[type, torch.dtype], bool] = {}  # (norm class, weight dtype) -> `LeanNorm` computes it


def _computes_like(norm: nn.Module) -> bool:
    """Whether `LeanNorm` gives `norm`'s own fp32 output bit for bit (probed once per class on seeded inputs of
    several scales)."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(eps, float):
        return False
    kind = (type(norm), weight.dtype)
    if kind not in _NORM_CHECKED:
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(2, 5, weight.shape[-1], generator=gen) * torch.tensor([1e-3, 30.0]).view(2, 1, 1)
        with torch.no_grad():
            _NORM_CHECKED[kind] = weight.dtype == torch.float32 and torch.equal(LeanNorm(norm)(probe), norm(probe))
    return _NORM_CHECKED[kind]


_SILU_CHECKED: dict[type, bool] = {}  # activation class -> it computes torch's SiLU


def _is_silu(act_fn: nn.Module) -> bool:
    """Whether `act_fn` is a SiLU module (torch's or transformers') with its class's forward, computing
    `torch.nn.functional.silu` bit for bit (probed once per class)."""
    kind = type(act_fn)
    if kind.__name__ not in ("SiLU", "SiLUActivation") or "forward" in act_fn.__dict__:
        return False
    if kind not in _SILU_CHECKED:
        probe = torch.randn(3, 257, generator=torch.Generator().manual_seed(0)) * 8
        with torch.no_grad():
            _SILU_CHECKED[kind] = torch.equal(act_fn(probe), torch.nn.functional.silu(probe))
    return _SILU_CHECKED[kind]


def _rope(states: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor], head_dim: int) -> torch.Tensor:
    """apply_rotary_pos_emb on `states` `[B, heads, T, D]`: x * cos + rotate_half(x) * sin, with rotate_half(x) * sin
    = cat(-x2, x1) * cat(sin1, sin2) computed as cat(x2, x1) * cat(-sin1, sin2) — the same products exactly
    (negating a factor negates the rounded product), in two operations instead of five; `factors` = (cos, folded
    sin) `[B, 1, T, D]`. Element by element, so q and k rotated together or apart get the same bits."""
    cos, folded_sin = factors
    return (states * cos).add_(states.roll(head_dim // 2, -1).mul_(folded_sin))


def _project(x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """`linear(x)`, directly on its packed weight when it has one."""
    if isinstance(linear, PackedLinear):
        return _linear(x, linear.packed)
    return linear(x)
