"""A step's whole decoder stack in one compiled call (`fused_stack.py`): bit for bit what the per-layer fused steps
compute (logits and cache), the model's own forward for every call it does not compute, weights changed in place
and regrown cache slabs followed, and the model's forward given back."""

from __future__ import annotations

import copy

import pytest
import torch
from test_batch import padded_batch
from tiny_models import (FUSED_ARCHITECTURES, build_tiny_model, fused_test_model, repetitive_prompt,
                         three_steps)

from lookahead import (Lookahead, LookaheadConfig, attention_kernel, cache_layer, fused_layer, fused_stack, hf,
                       streamed_gemm)
from lookahead.attention import tree_attention
from lookahead.compat import CACHE_KWARG
from lookahead.lean_layers import lean_layers
from lookahead.packed_linear import packed_linears
from lookahead.row_kernels import RowKernels, apply_row_kernels

pytestmark = pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and streamed_gemm.available()),
                                reason="needs oneDNN and the streamed kernel (a CPU with FMA)")


def _model(name: str, **extra):
    return fused_test_model(name, 7, **extra)


class _Counts:
    """Calls of the stack's compiled call and of the per-layer fused step."""

    def __init__(self, monkeypatch):
        self.stack = self.layer = 0
        monkeypatch.setattr(fused_stack, "decoder_stack", self._counted(fused_stack.decoder_stack, "stack"))
        monkeypatch.setattr(fused_layer, "decoder_layer", self._counted(fused_layer.decoder_layer, "layer"))

    def _counted(self, real, name: str):
        def counted(*args):
            setattr(self, name, getattr(self, name) + 1)
            return real(*args)

        return counted


def _per_layer_only(monkeypatch):
    """No stack is installed: every layer runs its own fused step."""
    monkeypatch.setattr(fused_stack.FusedStack, "supports", staticmethod(lambda *args: False))


def _flat(logits, cache):
    return list(logits) + [state for layer in cache.layers for state in (layer.keys, layer.values)]


def _three_steps(model, prompt, kernels=RowKernels(0, 8)):
    with torch.no_grad(), packed_linears(model), tree_attention(model), lean_layers(model):
        apply_row_kernels(model, kernels)
        return _flat(*three_steps(model, prompt))


def _assert_equal(first, second):
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("attention", ["grouped", "compiled", "numba"])
@pytest.mark.parametrize("name", list(FUSED_ARCHITECTURES))
def test_stack_steps_are_the_per_layer_fused_steps_bit_for_bit(name, attention, monkeypatch):
    monkeypatch.setattr(fused_layer, "GROUPED", attention == "grouped")  # decode_attention's kernel where it runs
    if attention == "numba":
        monkeypatch.setattr(attention_kernel, "supports", lambda head_dim: False)
    model, prompt = _model(name), repetitive_prompt(2, length=30)
    counts = _Counts(monkeypatch)
    stacked = _three_steps(model, prompt)
    assert (counts.stack, counts.layer) == (2, 0)  # the one-row and the tree step, every layer in one call
    with monkeypatch.context() as patch:
        _per_layer_only(patch)
        per_layer = _three_steps(model, prompt)
    assert counts.layer == 2 * 3
    _assert_equal(stacked, per_layer)


def _hooked(model):
    model.model.layers[1].register_forward_hook(lambda module, args, output: None)


@pytest.mark.parametrize("case", ["hook-on-a-layer", "global-hook", "rows-beyond-the-streamed-kernel", "grads"])
def test_calls_the_stack_does_not_compute_run_the_models_own_forward(case, monkeypatch):
    model, prompt = _model("llama"), repetitive_prompt(3, length=30)
    kernels = RowKernels(0, 4 if case == "rows-beyond-the-streamed-kernel" else 8)
    if case == "hook-on-a-layer":
        _hooked(model)
    handle = (torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
              if case == "global-hook" else None)
    try:
        counts = _Counts(monkeypatch)
        if case == "grads":
            with torch.enable_grad(), packed_linears(model), tree_attention(model), lean_layers(model):
                apply_row_kernels(model, kernels)
                logits, _ = three_steps(model, prompt)
            assert counts.stack == 0 and logits[-1].requires_grad
            return
        stacked = _three_steps(model, prompt, kernels)
    finally:
        if handle is not None:
            handle.remove()
    expected_stack = 1 if case == "rows-beyond-the-streamed-kernel" else 0  # there: the one-row step
    assert counts.stack == expected_stack
    with monkeypatch.context() as patch:
        _per_layer_only(patch)
        _assert_equal(stacked, _three_steps(model, prompt, kernels))


def test_the_final_norm_is_lean_and_its_hooks_still_run(monkeypatch):
    """The stack applies the final norm as `LeanNorm` (same bits: the steps equal the per-layer path, which runs the
    norm module); a hook on the norm module makes it call the module, so the hook sees every step."""
    model, prompt = _model("llama"), repetitive_prompt(5, length=30)
    with packed_linears(model), tree_attention(model), lean_layers(model):
        assert model.model.forward.final_norm is not None
    seen = []
    handle = model.model.norm.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[1]))
    try:
        counts = _Counts(monkeypatch)
        hooked = _three_steps(model, prompt)
    finally:
        handle.remove()
    assert counts.stack == 2 and seen == [prompt.shape[1] - 1, 1, 6]  # the prefill, the one-row and the tree step
    with monkeypatch.context() as patch:
        _per_layer_only(patch)
        _assert_equal(hooked, _three_steps(model, prompt))


def test_hidden_states_asked_for_come_from_the_models_own_forward(monkeypatch):
    model, prompt = _model("llama"), repetitive_prompt(4, length=30)
    counts = _Counts(monkeypatch)
    with torch.no_grad(), packed_linears(model), tree_attention(model), lean_layers(model):
        apply_row_kernels(model, RowKernels(0, 8))
        from transformers import DynamicCache

        from lookahead.cache import make_compactable

        cache = DynamicCache()
        model(prompt[:, :-1], **{CACHE_KWARG: cache}, use_cache=True)
        make_compactable(cache, model.config, 4096)
        out = model(prompt[:, -1:], **{CACHE_KWARG: cache}, use_cache=True, output_hidden_states=True)
    assert counts.stack == 0 and counts.layer == 3  # each layer fused on its own, the hidden states recorded
    assert len(out.hidden_states) == 4


def test_weights_changed_in_place_and_a_new_cache_reach_the_stack(monkeypatch):
    def steps(model, prompt):
        with torch.no_grad(), packed_linears(model), tree_attention(model), lean_layers(model):
            apply_row_kernels(model, RowKernels(0, 8))
            first = _flat(*three_steps(model, prompt))
            model.model.layers[2].mlp.down_proj.weight.mul_(0.5)  # in place, between two forwards
            model.model.layers[0].self_attn.q_proj.weight.add_(0.01)
            return first + _flat(*three_steps(model, prompt))

    prompt = repetitive_prompt(5, length=30)
    counts = _Counts(monkeypatch)
    stacked = steps(_model("qwen2"), prompt)
    assert counts.stack == 4
    with monkeypatch.context() as patch:
        _per_layer_only(patch)
        per_layer = steps(_model("qwen2"), prompt)
    _assert_equal(stacked, per_layer)


def test_weights_are_checked_on_the_first_step_of_each_cache_and_row_count(monkeypatch):
    """The ~200 parameters' versions are read once per cache (generation) and row count, not on every step."""
    checks = []
    real = fused_stack.weights_stamp
    monkeypatch.setattr(fused_stack, "weights_stamp", lambda packed: checks.append(1) or real(packed))
    model, prompt = _model("llama"), repetitive_prompt(4, length=30)
    with torch.no_grad(), packed_linears(model), tree_attention(model), lean_layers(model):
        apply_row_kernels(model, RowKernels(0, 8))
        _, cache = three_steps(model, prompt)  # a one-row and a 6-row step: two row counts
        assert len(checks) == 2 + 1  # and the first build
        stack = model.model.forward
        for _ in range(3):  # more steps of a row count this cache has run
            stack(input_ids=prompt[:, -1:], **{CACHE_KWARG: cache}, use_cache=True)
        assert len(checks) == 3
        three_steps(model, prompt)  # a new cache: checked again
        assert len(checks) == 5


def test_the_stack_forward_is_installed_only_within_the_block_and_only_fused():
    model = _model("llama")
    with torch.no_grad(), packed_linears(model), lean_layers(model):
        assert isinstance(model.model.__dict__.get("forward"), fused_stack.FusedStack)
    assert "forward" not in model.model.__dict__
    with torch.no_grad(), packed_linears(model), lean_layers(model, fused=False):
        assert "forward" not in model.model.__dict__
    windowed = build_tiny_model("mistral", dtype=torch.float32, layers=2, sliding_window=8)
    with torch.no_grad(), packed_linears(windowed), lean_layers(windowed):
        assert "forward" not in windowed.model.__dict__  # layers with a sliding window are not fused


@pytest.mark.parametrize("config", [LookaheadConfig(), LookaheadConfig.off()], ids=["speculate", "off"])
def test_greedy_through_the_stack_with_slabs_regrown_is_plain_greedy(config, monkeypatch):
    monkeypatch.setattr(cache_layer, "MIN_HEADROOM", 1)  # the slabs move to larger buffers again and again
    monkeypatch.setattr(hf, "row_kernels_for", lambda model, refresh=False, quiet=False: RowKernels(0, 64))
    model = _model("llama")
    counts = _Counts(monkeypatch)
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        plain = model.generate(prompt, do_sample=False, max_new_tokens=60)
        fast = model.generate(prompt, do_sample=False, max_new_tokens=60, custom_generate=Lookahead(config))
        assert torch.equal(plain, fast)
    assert counts.stack > 0 and counts.layer == 0


def _batched_step_inputs(prefix: int, entries: list[int]):
    """A 3-row chain step for the batch entries `entries` after `prefix` cached slots: positions [B, 3] and the
    additive mask [B, 1, 3, prefix + 3] (causal over the new rows; entry e also hides cached slot e, as padding
    holes do)."""
    low = torch.finfo(torch.float32).min
    mask = torch.zeros(len(entries), 1, 3, prefix + 3)
    for b, entry in enumerate(entries):
        mask[b, 0, :, entry] = low
        for row in range(3):
            mask[b, 0, row, prefix + row + 1:] = low
    positions = torch.arange(prefix, prefix + 3)[None].expand(len(entries), 3)
    return positions, mask


def _steps_on(model, cache, tokens: torch.Tensor, prefix: int, entries: list[int]) -> list:
    """Logits of a one-token step (tokens[:, :1]) and of a 3-row chain step (tokens[:, 1:4]) of the batch entries
    `entries` on `cache`."""
    outs = [model(tokens[:, :1], **{CACHE_KWARG: cache}, use_cache=True).logits]
    positions, mask = _batched_step_inputs(prefix + 1, entries)
    outs.append(model(input_ids=tokens[:, 1:4], position_ids=positions, attention_mask=mask, **{CACHE_KWARG: cache},
                      use_cache=True).logits)
    return outs


@pytest.mark.parametrize("name", list(FUSED_ARCHITECTURES))
def test_a_batch_through_the_stack_computes_every_entry_as_it_computes_alone(name, monkeypatch):
    """Each entry's logits and cache after batched steps (every product over all entries' rows, each entry's rows
    attending over its own cache entry with its own mask and positions) are bit for bit those of the entry
    stepped alone from the same cache."""
    from transformers import DynamicCache

    from lookahead.cache import make_compactable

    model = _model(name)
    prompts = torch.cat([repetitive_prompt(seed, length=20) for seed in (4, 5, 6)])
    tokens = torch.tensor([[3, 9, 12, 5], [7, 7, 2, 30], [11, 1, 4, 8]])
    calls = []
    real = fused_stack.decoder_stack
    monkeypatch.setattr(fused_stack, "decoder_stack", lambda *args: calls.append(args[-1]) or real(*args))
    with torch.no_grad(), packed_linears(model), tree_attention(model), lean_layers(model):
        apply_row_kernels(model, RowKernels(0, 16))
        cache = DynamicCache()
        model(prompts, **{CACHE_KWARG: cache}, use_cache=True)
        make_compactable(cache, model.config, 4096, batch_size=3)
        alone = []
        for b in range(3):
            single = copy.deepcopy(cache)
            single.batch_select_indices(torch.tensor([b]))
            logits = _steps_on(model, single, tokens[b:b + 1], prompts.shape[1], [b])
            alone.append((logits, single))
        assert calls == [1] * 6
        batched = _steps_on(model, cache, tokens, prompts.shape[1], [0, 1, 2])
    assert calls[6:] == [3, 3]
    for b, (logits, single) in enumerate(alone):
        for one, many in zip(logits, batched, strict=True):
            assert torch.equal(one[0], many[b])
        for one, many in zip(single.layers, cache.layers, strict=True):
            assert torch.equal(one.keys[0], many.keys[b]) and torch.equal(one.values[0], many.values[b])


@pytest.mark.parametrize("name", list(FUSED_ARCHITECTURES))
def test_a_left_padded_entry_computes_what_it_computes_without_its_padding(name, monkeypatch):
    """An entry whose cache starts with padding slots (left padding: zeros its mask hides) gets, in a batch step
    through the stack, bit for bit the logits and new cache slots it gets alone from a cache without them: its
    attention starts at its first real slot (`fused_kernels.hidden_lead`)."""
    from transformers import DynamicCache

    from lookahead.cache import make_compactable

    model, padding = _model(name), 6
    calls = []
    real = fused_stack.decoder_stack
    monkeypatch.setattr(fused_stack, "decoder_stack", lambda *args: calls.append(args[-1]) or real(*args))
    short, long = repetitive_prompt(4, length=20), repetitive_prompt(5, length=20 + padding)
    tokens = torch.tensor([[3, 9, 12, 5], [7, 7, 2, 30]])
    low = torch.finfo(torch.float32).min
    with torch.no_grad(), packed_linears(model), tree_attention(model), lean_layers(model):
        apply_row_kernels(model, RowKernels(0, 16))
        alone, batch = DynamicCache(), DynamicCache()
        model(short, **{CACHE_KWARG: alone}, use_cache=True)
        model(long, **{CACHE_KWARG: batch}, use_cache=True)
        for one, two in zip(alone.layers, batch.layers):
            pad = one.keys.new_zeros(1, one.keys.shape[1], padding, one.keys.shape[3])
            keys, values = torch.cat([pad, one.keys], 2), torch.cat([pad, one.values], 2)
            two.keys, two.values = torch.cat([keys, two.keys]), torch.cat([values, two.values])
        make_compactable(alone, model.config, 4096, batch_size=1)
        make_compactable(batch, model.config, 4096, batch_size=2)
        outs = {}
        for key, cache, entries, hidden in (("alone", alone, tokens[:1], 0), ("batch", batch, tokens, padding)):
            prefix = cache.get_seq_length()
            positions = torch.arange(20, 24)[None].expand(len(entries), 4).clone()
            positions[1:] += padding  # the long prompt's positions
            steps = []
            for rows in (slice(0, 1), slice(1, 4)):
                count, cached = rows.stop - rows.start, cache.get_seq_length()
                mask = torch.zeros(len(entries), 1, count, cached + count)
                mask[0, 0, :, :hidden] = low
                mask[:, 0, :, cached:] = torch.zeros(count, count).masked_fill(
                    torch.ones(count, count, dtype=torch.bool).triu(1), low)
                steps.append(model(input_ids=entries[:, rows], position_ids=positions[:, rows], attention_mask=mask,
                                   **{CACHE_KWARG: cache}, use_cache=True).logits)
            outs[key] = (steps, prefix)
    assert calls == [1, 1, 2, 2]  # every step on the stack, the batch's as one call
    (lone, prefix), (many, _) = outs["alone"], outs["batch"]
    for one, both in zip(lone, many, strict=True):
        assert torch.equal(one[0], both[0])
    for one, both in zip(alone.layers, batch.layers, strict=True):
        assert torch.equal(one.keys[0, :, prefix:prefix + 4], both.keys[0, :, prefix + padding:prefix + padding + 4])


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_batched_greedy_through_the_stack_is_plain_batched_greedy(name, monkeypatch):
    """Left-padded batches of different prompts (entries stopping at different lengths on an EOS), speculating,
    with every decoding step of the batch on the stack: plain batched `generate`'s tokens."""
    monkeypatch.setattr(hf, "row_kernels_for", lambda model, refresh=False, quiet=False: RowKernels(0, 64))
    model = _model(name)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 17
    batches = []
    real = fused_stack.decoder_stack
    monkeypatch.setattr(fused_stack, "decoder_stack", lambda *args: batches.append(args[-1]) or real(*args))
    for lengths in ((24, 16, 20), (18, 26, 12), (30, 10, 22)):
        ids, mask = padded_batch(lengths)
        plain = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
        fast = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40,
                              custom_generate=Lookahead())
        assert torch.equal(plain, fast), lengths
    assert 3 in batches
