"""A decoder layer's step in one compiled call: what `lean_layers` runs as ~40 PyTorch operations per layer.

After the lean forward, a one-row step of the default model still spent ~15 ms of its ~45 ms outside the matrix
products on an AVX2 machine (2 cores): ~40 dispatched operations per layer (norms, RoPE, the cache append, SDPA,
SiLU, residuals, views) and the Python around them, each costing microseconds after the layer's weights have
streamed through the caches. `FusedLayer` runs the whole layer as one numba call (`fused_kernels.decoder_layer`)
whose products are the very `streamed_gemm` products the lean forward makes, so a step's products are
bit-identical; the rest computes the same formulas with its own reductions (see `fused_kernels`): the logits
differ from the lean forward's in the last bits (~1e-6 relative), as any change of kernel does.

It takes a call only when it computes exactly what the layer means: batch size 1, fp32 on the CPU, every product
of this row count on the streamed kernel with float32 or exact block-form panels (`affine_weights`), the layer's
cache a `SlabLayer` already holding the prompt (the keys and values are written into its slab), and a verification
mask (`[1, 1, T, cached + T]`, additive float) or a single row with none. Anything else (a prefill, a sliding
window, attention extras, a bool mask) returns None and the lean forward runs. The attention runs on
`decode_attention`'s kernel when the head size is a multiple of the CPU's vector width (16 floats with AVX-512, 8
with AVX2), else on `attention_kernel`'s compiled loops when it is a multiple of 8 (`attention_loops`); with
numba's loops, a step of many rows over a long cache attends with PyTorch's SDPA between two compiled calls
(`COMPILED_ATTENTION_MAX`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from . import attention_kernel, decode_attention, streamed_gemm
from .cache_layer import SlabLayer
from .fused_kernels import attention_inputs, decoder_layer, entry_leads, layer_output
from .packed_linear import FusedMember, PackedLinear
from .thread_governor import numba_threads

_ATTENTIONS = ("sdpa", "lookahead_tree")  # implementations whose meaning the fused attention computes
_EXTRAS = ("position_bias", "cache", "softcap", "s_aux", "output_attentions")  # attention features it lacks
_NO_MASK = np.empty((0, 0), np.float32)
_NUMBA_ATTENTION = np.empty(0, np.int64)  # no compiled attention loops: numba's
# panels computing the weights' own products (int8: approximations), the tile kernels' records among them
_KINDS = ("float32", "affine4", "affine4h", "scaled8", *streamed_gemm.AMX_KINDS)
# With numba's attention loops (heads not a multiple of 8 floats), steps of more rows × slots than this attend with
# PyTorch's SDPA between two compiled calls: numba's loops computed each (row, head) on its own, quicker for a few
# rows and short caches; SDPA's blocked products for more (whole steps of the default model, AVX2, 2 threads: about
# even at 12 rows × 312 slots, numba's loops ahead at 4 × 1004, 45.8 vs 51.7 ms, SDPA at 12 × 1012, 56.1 vs 63.9).
# The compiled loops (`attention_kernel`) attend every step: whole steps of the default model, same machine, against
# SDPA from 4096 row-slots on: 8 rows × 808 slots 50.8 vs 60.0 ms, 16 × 816 97.0 vs 100.5, 4 × 1504 39.9 vs 52.4,
# 8 × 3008 90.6 vs 112.5, 16 × 3016 159.4 vs 169.9.
COMPILED_ATTENTION_MAX = 4096
GROUPED = True  # decode_attention's kernel where it runs (False: attention_kernel's loops, for comparisons)


def attention_loops(head_dim: int) -> np.ndarray:
    """The fused attention's compiled code for heads of `head_dim` floats (`fused_kernels.attend_after`'s
    `kernels`): `decode_attention`'s kernel for this CPU's vector width where it runs (AVX-512: heads of whole
    16-float vectors; AVX2: 8-float) and GROUPED is on, else `attention_kernel`'s two loops (heads of whole 8-float
    vectors), else none (numba's loops)."""
    lanes = decode_attention.host_lanes()
    if GROUPED and decode_attention.supports(head_dim, lanes) and decode_attention.available(lanes):
        return np.array([decode_attention.address(head_dim, lanes)], np.int64)
    if attention_kernel.supports(head_dim):
        return np.array(attention_kernel.attention_addresses(head_dim), np.int64)
    return _NUMBA_ATTENTION


class FusedLayer:
    """One decoder layer's fused step (see the module docstring); `None` from a call means "not this call"."""

    def __init__(self, layer: nn.Module, head_dim: int, query_heads: int, key_heads: int, intermediate: int,
                 norms: tuple[torch.Tensor, torch.Tensor], eps: tuple[torch.Tensor, torch.Tensor]):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx = attn.layer_idx
        self.attn_config = attn.config
        self.packed = (attn.q_proj.group.packed, attn.o_proj.packed, mlp.gate_proj.group.packed, mlp.down_proj.packed)
        self.norms = torch.stack([n.detach() for n in norms]).contiguous().numpy()
        size = self.norms.shape[1]
        self.floats = np.array([float(eps[0]), float(eps[1]), size, attn.scaling], np.float32)
        self.scaling = attn.scaling  # SDPA's scale as the layer's own attention passes it
        self.shape = (query_heads, key_heads, head_dim, intermediate)
        self.attention_loops = attention_loops(head_dim)
        self._weights: tuple | None = None  # the StreamedWeights the arrays below were built from
        self._slab_views: tuple | None = None  # (key slab, value slab, their numpy views)
        self._arrays: tuple | None = None

    @staticmethod
    def supports(layer: nn.Module) -> bool:
        """Whether the layer's four products are packed (q/k/v and gate/up stacked) and the streamed kernel builds."""
        attn, mlp = layer.self_attn, layer.mlp
        return (isinstance(attn.q_proj, FusedMember) and isinstance(mlp.gate_proj, FusedMember)
                and isinstance(attn.o_proj, PackedLinear) and isinstance(mlp.down_proj, PackedLinear)
                and streamed_gemm.available())

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, past_key_values,
                 cos: torch.Tensor, folded_sin: torch.Tensor, window: int | None, kwargs: dict) -> torch.Tensor | None:
        """The layer's output `[1, T, hidden]` for `hidden_states`, its keys and values appended to the cache; None
        when this call is not one the fused step computes."""
        rows = hidden_states.shape[1]
        mask = self._mask(attention_mask, rows, past_key_values)
        if mask is None or window is not None or hidden_states.shape[0] != 1 or any(kwargs.get(name) is not None
                                                                                    for name in _EXTRAS):
            return None
        if self.attn_config._attn_implementation not in _ATTENTIONS:
            return None
        arrays = self.streamed_arrays(rows)
        if arrays is None:
            return None
        layer = past_key_values.layers[self.layer_idx]
        start = layer.get_seq_length()
        keys, values = layer.reserve(rows)
        source = _rows(hidden_states)  # before `_new_output` replaces the previous layer's output
        out, out_rows = _new_output(hidden_states)
        common = (arrays[3], arrays[4], compiled_threads(), *arrays[:2], self.floats, arrays[2], self.norms,
                  source)
        tables = (_plane(cos), _plane(folded_sin), *self._slabs(keys, values), start)
        if self.attends_compiled(rows, start):
            decoder_layer(*common, *tables, mask, entry_leads(mask, 1), self.attention_loops, out_rows)
            return out
        queries = torch.empty(rows, self.shape[0], self.shape[2])
        attention_inputs(*common, *tables, queries.numpy())
        attended = torch.nn.functional.scaled_dot_product_attention(
            queries.transpose(0, 1)[None], keys[:, :, :start + rows], values[:, :, :start + rows],
            attn_mask=attention_mask, scale=self.scaling, enable_gqa=True)  # [1, heads, rows, D]
        layer_output(*common, attended[0].transpose(0, 1).contiguous().numpy(), out_rows)
        return out

    def _slabs(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The cache's key and value slabs `[1, H, capacity, D]` as numpy arrays (views), kept while the slabs are
        the same tensors."""
        if self._slab_views is None or self._slab_views[0] is not keys or self._slab_views[1] is not values:
            self._slab_views = (keys, values, keys.numpy(), values.numpy())
        return self._slab_views[2:]

    def _mask(self, attention_mask: torch.Tensor | None, rows: int, past_key_values) -> np.ndarray | None:
        """The mask as [rows, cached + rows] float32 (or the empty "none" mask for a lone row), or None when the
        call's mask or cache is not one the fused step handles."""
        layer = slab_layer(past_key_values, self.layer_idx)
        return None if layer is None else step_mask(attention_mask, rows, layer.get_seq_length())

    def attends_compiled(self, rows: int, start: int) -> bool:
        """Whether a step of `rows` rows over `start` cached slots attends inside the compiled call (always with
        the compiled loops; with numba's, up to COMPILED_ATTENTION_MAX rows × slots)."""
        return rows == 1 or self.attention_loops.shape[0] > 0 or rows * (start + rows) <= COMPILED_ATTENTION_MAX

    def streamed_arrays(self, rows: int) -> tuple | None:
        """(dims, panel addresses, biases, kernel addresses, prepare address) of the four products, or None unless
        all four compute `rows` rows on the streamed kernel with float32, exact block-form or AMX panels."""
        if not all(p.default_rows < rows <= p.streamed_rows for p in self.packed):
            return None
        weights = tuple(p.streamed() for p in self.packed)
        if self._weights is None or any(new is not old for new, old in zip(weights, self._weights)):
            self._weights, self._arrays = weights, self._build(weights)
        return self._arrays

    def _build(self, weights: tuple) -> tuple | None:
        """The arrays `decoder_layer` reads for these streamed weights, their kernels' addresses and the address of
        the call that prepares a product's rows before the threads start (None: int8 panels, or products whose
        kernels prepare rows differently: the AMX kernel's beside others)."""
        if any(w.scales is not None or w.kind not in _KINDS for w in weights):
            return None
        prepare = {streamed_gemm.prepare_address(w.kind) for w in weights}
        if len(prepare) != 1:
            return None
        widths = [w.panels.shape[0] * streamed_gemm.vector_width() for w in weights]
        lengths = [0 if w.bias is None else w.out_features for w in weights]
        biases = np.zeros((4, max(1, max(lengths))), np.float32)
        for i, w in enumerate(weights):
            if w.bias is not None:
                biases[i, :w.out_features] = w.bias.detach().float().numpy()
        dims = np.array([*self.shape, streamed_gemm.vector_width(), *widths, *lengths], np.int64)
        panels = np.array([w.panels.data_ptr() for w in weights], np.int64)
        kernels = np.array([streamed_gemm._kernel_address(w.kind)[0] for w in weights], np.int64)
        return dims, panels, biases, kernels, prepare.pop()




def compiled_threads() -> int:
    """The threads a compiled step's products use: torch's thread count, within what numba may run."""
    return numba_threads(torch.get_num_threads())


def slab_layer(past_key_values, layer_idx: int, batch: int = 1) -> SlabLayer | None:
    """Layer `layer_idx` of the cache when the fused step can write into it: a `SlabLayer` holding `batch`
    sequences' states (else None)."""
    layers = getattr(past_key_values, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    if type(layer) is not SlabLayer or not layer.is_initialized or layer.batch_size != batch:
        return None
    return layer


def step_mask(attention_mask: torch.Tensor | None, rows: int, cached: int) -> np.ndarray | None:
    """A step's mask as [rows, cached + rows] float32 (the empty "none" mask for a lone row without one), or None
    when it is not a mask the fused step handles (an additive float `[1, 1, rows, cached + rows]` mask)."""
    if attention_mask is None:
        return _NO_MASK if rows == 1 else None
    if attention_mask.dtype != torch.float32 or tuple(attention_mask.shape) != (1, 1, rows, cached + rows):
        return None
    return _plane(attention_mask)


def batch_step_mask(attention_mask: torch.Tensor | None, batch: int, rows: int, cached: int) -> np.ndarray | None:
    """`step_mask` for a batch of `batch` entries of `rows` rows each: the additive float `[B, 1, rows, cached +
    rows]` mask as [B · rows, cached + rows] float32, entry after entry (the empty "none" mask for lone rows without
    one), or None when it is not such a mask."""
    if batch == 1 or (attention_mask is None and rows == 1):
        return step_mask(attention_mask, rows, cached)
    if (attention_mask is None or attention_mask.dtype != torch.float32
            or tuple(attention_mask.shape) != (batch, 1, rows, cached + rows)):
        return None
    return attention_mask.reshape(batch * rows, cached + rows).contiguous().numpy()


# Every layer of a forward passes the same mask and RoPE tables, and each layer's input is the previous one's output:
# their numpy views are made once and found again by identity (a few microseconds each, ~1 ms over a step of 30
# layers otherwise). Only views are kept (a plane that is not contiguous is copied anew on every call), so an
# in-place change of a tensor is always seen; an entry holds its tensor, so its id is not reused while it is kept.
_PLANES: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
_MAX_PLANES = 8
_last_output: tuple = (None, None)  # (the last output tensor a fused layer made, its rows' numpy view)


def _plane(tensor: torch.Tensor) -> np.ndarray:
    """tensor[0, 0] (a `[1, 1, T, S]` mask or `[1, 1, T, D]` RoPE table) as a float32 numpy array."""
    entry = _PLANES.get(id(tensor))
    if entry is not None and entry[0] is tensor:
        return entry[1]
    plane = tensor[0, 0]
    if not plane.is_contiguous():
        return plane.contiguous().numpy()
    if len(_PLANES) >= _MAX_PLANES:
        _PLANES.clear()
    _PLANES[id(tensor)] = (tensor, plane.numpy())
    return _PLANES[id(tensor)][1]


def _rows(hidden_states: torch.Tensor) -> np.ndarray:
    """hidden_states[0] (`[1, T, hidden]`) as a float32 numpy array: the previous fused layer's view of its output
    when that is what the layer got."""
    tensor, rows = _last_output
    if tensor is hidden_states:
        return rows
    return hidden_states[0].contiguous().numpy()


def _new_output(hidden_states: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """A `[1, T, hidden]` float32 output tensor shaped like hidden_states and its rows as a numpy view."""
    global _last_output
    rows = np.empty(hidden_states.shape[1:], np.float32)
    out = torch.from_numpy(rows).unsqueeze(0)
    _last_output = (out, rows)
    return out, rows
