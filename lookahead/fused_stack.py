"""A step's whole decoder stack in one compiled call: the fused layers without 30 trips through Python.

With every layer fused (`fused_layer.py`), a one-row step of the default model still spent ~3.4 ms of its ~15 ms in
the decoder stack's Python (AVX2, 2 cores, measured with the compiled calls stubbed out): transformers' model
forward and 30 module calls, and per layer the eligibility checks, four weight-version checks, the cache slots and
the numpy views (~60 µs a layer). `FusedStack` is installed as the forward of the module holding the layers
(`LlamaModel`, `Qwen2Model`, `MistralModel`) while `lean_layers` is on. When every layer's fused step computes a
call, it checks them all at once, embeds the tokens and reads RoPE's factors with the model's own modules (from a
table where that gives the same bits, `rope_table`), reserves each layer's cache slots, runs every layer in one
`fused_kernels.decoder_stack` call (each layer exactly the `decoder_layer` call the per-layer path makes, so the
logits are bit-identical to it) and applies the model's final norm — as `lean_layers.LeanNorm` where that computes
the norm's own output bit for bit and the norm has no hooks (a third of the dispatched operations: ~0.4 ms less per
step in situ, 288 one-row steps 3.85 → 3.74 s), else the norm module itself. Any other call (a prefill, grads, hooks
on the layers, hidden states or attentions asked for, a row count or cache the fused step does not handle) runs the
model's own forward, whose layers then run their lean or fused forward one by one.

A batch (B sequences of T rows each, as the batched decoder steps them: an additive `[B, 1, T, cached + T]` mask
with each sequence's padding holes, positions `[B, T]`) runs in the same call: every product takes all B · T rows
at once — the streamed kernel computes each row as it computes it alone, so every sequence's numbers are those of
its own batch-1 step (tested bit for bit) — and each sequence's rows attend over its own entry of the cache slabs
`[B, H, capacity, D]`. Measured before/after on the default model (Zen 5, 2 threads, left-padded prompts of code,
summarization, rag and translation, 64 new tokens, outputs identical to plain batched greedy): decoding after the
prefill 190 → 277 tok/s at batch 4 and 219 → 281 tok/s at batch 8, where batches took transformers' own stack with
the lean layers before."""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from .compat import CACHE_KWARG, pop_cache
from .fused_kernels import decoder_stack
from .fused_layer import _ATTENTIONS, FusedLayer, _plane, batch_step_mask, compiled_threads, slab_layer
from .packed_linear import weights_stamp
from .rope_table import RopeTable

STACK_CLASSES = frozenset({"LlamaModel", "Qwen2Model", "MistralModel"})  # forwards of the form run here
_OUTPUT_FLAGS = ("output_hidden_states", "output_attentions")  # outputs only the model's own forward records


class FusedStack:
    """The forward of a decoder stack whose every layer has a fused step (see the module docstring)."""

    def __init__(self, stack: nn.Module, fused: list[FusedLayer], rotary, final_norm=None):
        self.stack, self.fused, self.rotary, self.final_norm = stack, fused, rotary, final_norm
        self.rope = RopeTable(stack.rotary_emb)
        self.own_forward = type(stack).forward.__get__(stack)
        self.layers = list(stack.layers)
        self.packed = [p for layer in fused for p in layer.packed]
        self.norms = np.ascontiguousarray(np.stack([layer.norms for layer in fused]))  # [layers, 2, size]
        self.floats = np.ascontiguousarray(np.stack([layer.floats for layer in fused]))  # [layers, 4]
        self._built: tuple | None = None  # (panels, stamp, stacked arrays) of the last build
        self._checked: tuple = (None, {})  # (weak reference to the cache checked, {rows: the arrays for it})
        self._slabs: tuple | None = None  # (slab tensors, their addresses, their capacities)

    @staticmethod
    def supports(stack: nn.Module, fused: list[FusedLayer | None], windows: list[int | None]) -> bool:
        """Whether `stack` is a supported model class with its own forward whose layers (in order) all have a fused
        step and no sliding window."""
        layers = getattr(stack, "layers", None)
        return (type(stack).__name__ in STACK_CLASSES and "forward" not in stack.__dict__
                and all(hasattr(stack, name) for name in ("embed_tokens", "rotary_emb", "norm"))
                and isinstance(layers, nn.ModuleList) and len(layers) == stack.config.num_hidden_layers
                and len(fused) == len(layers) and all(f is not None for f in fused)
                and all(f.layer_idx == i for i, f in enumerate(fused)) and all(w is None for w in windows))

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, inputs_embeds=None, use_cache: bool | None = None,
                 **kwargs):
        """The stack's output for `input_ids` `[1, T]`, as the model's own forward computes it (its layers fused;
        the cache comes in `kwargs` by either of its names, `compat.pop_cache`)."""
        past_key_values = pop_cache(kwargs)
        out = None
        if inputs_embeds is None and input_ids is not None and use_cache:
            out = self._step(input_ids, attention_mask, position_ids, past_key_values, kwargs)
        if out is None:
            return self.own_forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    inputs_embeds=inputs_embeds, use_cache=use_cache,
                                    **{CACHE_KWARG: past_key_values}, **kwargs)
        return out

    def _step(self, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor | None, past_key_values,
              kwargs: dict) -> BaseModelOutputWithPast | None:
        """The fused step, or None when this call is not one it computes. A batch's B × T rows go through every
        product at once; each entry's rows attend over its own cache entry."""
        batch, rows = input_ids.shape
        if not self._plain_call(kwargs):
            return None
        caches = [slab_layer(past_key_values, i, batch) for i in range(len(self.fused))]
        if any(cache is None for cache in caches):
            return None
        start = caches[0].get_seq_length()
        if position_ids is None:  # as the model's own forward counts them
            position_ids = torch.arange(start, start + rows, device=input_ids.device)[None].expand(batch, rows)
        mask = batch_step_mask(attention_mask, batch, rows, start)
        arrays = self._arrays(batch * rows, past_key_values)
        if (mask is None or arrays is None or any(cache.get_seq_length() != start for cache in caches)
                or not self.fused[0].attends_compiled(rows, start) or position_ids.shape != (batch, rows)):
            return None
        hidden = self.stack.embed_tokens(input_ids)  # [B, T, size]
        if hidden.dtype != torch.float32 or hidden.requires_grad:
            return None
        cos, folded_sin = self._rope(hidden, position_ids)
        reserved = [cache.reserve(rows) for cache in caches]
        if any(key.shape[0] != batch for key, _ in reserved):
            return None
        slabs, capacities = self._slab_addresses(reserved)
        out = decoder_stack(arrays[3], arrays[4], compiled_threads(), arrays[0], arrays[1], self.floats,
                            arrays[2], self.norms, hidden.reshape(batch * rows, -1).contiguous().numpy(), cos,
                            folded_sin, slabs, capacities, start, mask, self.fused[0].attention_loops,
                            batch)  # [B · T, size]
        return BaseModelOutputWithPast(last_hidden_state=self._norm(torch.from_numpy(out).view(batch, rows, -1)),
                                       **{CACHE_KWARG: past_key_values})

    def _rope(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(cos, folded sin) `[B · T, D]` for the step's rows: from the RoPE table where the model's rotary module
        has one (`rope_table`), else from the module, as the layers' own forward gets them."""
        tables = self.rope.factors(position_ids)
        if tables is not None:
            return tables
        cos, folded_sin = self.rotary(self.stack.rotary_emb(hidden, position_ids=position_ids))  # [B, 1, T, D]
        if cos.shape[0] == 1:
            return _plane(cos), _plane(folded_sin)
        return (cos.reshape(-1, cos.shape[-1]).contiguous().numpy(),
                folded_sin.reshape(-1, folded_sin.shape[-1]).contiguous().numpy())

    def _norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm of `hidden`: `final_norm` unless the norm module has hooks to run."""
        norm = self.stack.norm
        if self.final_norm is None or norm._forward_hooks or norm._forward_pre_hooks:
            return norm(hidden)
        return self.final_norm(hidden)

    def _plain_call(self, kwargs: dict) -> bool:
        """Whether nothing beyond the stack's output is asked for and every layer would run its fused step: no
        grads or training, no hooks on the layers, no recorded outputs, an attention the fused step computes."""
        config = self.stack.config
        return (not torch.is_grad_enabled() and not self.stack.training
                and not any(getattr(config, flag, False) if kwargs.get(flag) is None else kwargs[flag]
                            for flag in _OUTPUT_FLAGS)
                and all(value is None for name, value in kwargs.items() if name not in _OUTPUT_FLAGS)
                and config._attn_implementation in _ATTENTIONS
                and not any(layer.training or layer._forward_hooks or layer._forward_pre_hooks
                            for layer in self.layers)
                and not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks))

    def _arrays(self, rows: int, cache) -> tuple | None:
        """(dims, panels [layers, 4], biases [layers, 4, max N], kernels [layers, 4], the prepare call's address) of
        every layer, or None unless every product computes `rows` rows on the streamed kernel with panels the fused
        step reads (and all prepare their rows alike). Rebuilt from
        each layer's `FusedLayer.streamed_arrays` only when a parameter or a panel changed, which is checked on the
        first step of every `cache` (every generation) and whenever the row count is one this cache has not run:
        checking the ~200 parameters on every step cost ~0.5 ms of a ~20 ms step in situ (the check's Python runs
        between weight streams that evict its working set). A parameter changed in place *during* a generation
        (from a streamer, say) is not seen until the next one."""
        reference, by_rows = self._checked
        if reference is None or reference() is not cache:
            self._checked = (weakref.ref(cache), by_rows := {})
        if rows not in by_rows:
            by_rows[rows] = self._checked_arrays(rows)
        return by_rows[rows]

    def _checked_arrays(self, rows: int) -> tuple | None:
        """`_arrays` after checking every parameter and panel (rebuilt when one changed), or None when some product
        does not run `rows` rows on the streamed kernel."""
        if not all(p.default_rows < rows <= p.streamed_rows for p in self.packed):
            return None
        panels, stamp = [p.panels for p in self.packed], weights_stamp(self.packed)
        built = self._built
        if built is None or built[1] != stamp or any(a is not b for a, b in zip(panels, built[0])):
            self._built = built = self._build(rows)
        return built[2]

    def _build(self, rows: int) -> tuple:
        """(panels, stamp, stacked arrays or None) after building every layer's arrays anew."""
        layers = [layer.streamed_arrays(rows) for layer in self.fused]
        stacked = None
        if all(arrays is not None for arrays in layers) and all(
                np.array_equal(a[0], layers[0][0]) and a[4] == layers[0][4] for a in layers):
            width = max(a[2].shape[1] for a in layers)
            biases = np.zeros((len(layers), 4, width), np.float32)
            for i, arrays in enumerate(layers):
                biases[i, :, :arrays[2].shape[1]] = arrays[2]
            stacked = (layers[0][0], np.stack([a[1] for a in layers]), biases, np.stack([a[3] for a in layers]),
                       layers[0][4])
        return [p.panels for p in self.packed], weights_stamp(self.packed), stacked

    def _slab_addresses(self, slabs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[np.ndarray, np.ndarray]:
        """(addresses [layers, 2] of every layer's key and value slab, their capacities [layers]), kept while the
        slabs are the same tensors (a cache grows its slabs every few hundred slots). The slabs are `SlabLayer`'s
        own contiguous `[1, key heads, capacity, D]` float32 buffers, so the first batch entry starts at the
        address."""
        flat = [slab for pair in slabs for slab in pair]
        if self._slabs is None or len(flat) != len(self._slabs[0]) or any(
                a is not b for a, b in zip(flat, self._slabs[0])):
            if not all(slab.is_contiguous() and slab.dtype == torch.float32 for slab in flat):
                raise RuntimeError("a cache slab is not a contiguous float32 buffer")  # SlabLayer makes them so
            addresses = np.array([[key.data_ptr(), value.data_ptr()] for key, value in slabs], np.int64)
            capacities = np.array([key.shape[2] for key, _ in slabs], np.int64)
            self._slabs = (flat, addresses, capacities)
        return self._slabs[1], self._slabs[2]


def install(stack: nn.Module, fused: list[FusedLayer | None], windows: list[int | None], rotary,
            final_norm=None) -> bool:
    """Make `stack`'s forward a `FusedStack` when `FusedStack.supports` it; returns whether it did (`remove` undoes
    it). `final_norm`: a callable computing `stack.norm`'s output bit for bit, used when the norm has no hooks."""
    if not FusedStack.supports(stack, fused, windows):
        return False
    stack.forward = FusedStack(stack, fused, rotary, final_norm)
    return True


def remove(stack: nn.Module) -> None:
    """Give `stack` its own forward back."""
    if isinstance(stack.__dict__.get("forward"), FusedStack):
        del stack.forward
