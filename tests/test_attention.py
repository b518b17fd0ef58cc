"""The `lookahead_tree` attention backend: a tiny random Llama gives SDPA's logits whether the Triton kernel path
(forced on CPU, in Triton's interpreter) or the SDPA path runs, and the kernel is taken exactly when it applies."""

from __future__ import annotations


import importlib

import torch

import pytest
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface

import lookahead.kernels
from lookahead import attention
from lookahead.compat import CACHE_KWARG

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# tests/conftest.py switches Triton's interpreter on before triton is first imported when there is no GPU.
KERNEL_RUNS_HERE = DEVICE == "cuda" or importlib.import_module("lookahead.kernels.tree_attention")._interpreting()



def test_kernel_path_runs_in_this_process():
    """Fails (never skips) if the kernel could neither compile (CUDA) nor run in Triton's interpreter."""
    assert KERNEL_RUNS_HERE, "TRITON_INTERPRET must be set before triton is imported (see tests/conftest.py)"


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().to(DEVICE)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Force the kernel path on CPU too; returns the list of `tree_attention` calls' T (query rows)."""
    monkeypatch.setattr(attention, "FORCE_KERNEL", True)
    calls = []
    kernel = lookahead.kernels.tree_attention

    def counted(q, *args, **kwargs):
        calls.append(q.shape[2])
        return kernel(q, *args, **kwargs)

    monkeypatch.setattr(lookahead.kernels, "tree_attention", counted)
    return calls


def run_with(model, implementation, forward):
    """`forward(model)` with the model's attention set to `implementation`."""
    model.set_attn_implementation(implementation)
    try:
        with torch.no_grad():
            return forward(model)
    finally:
        model.set_attn_implementation("sdpa")


def chunked_prefill_then_decode(model):
    """Logits of an 8-token prefill, a 4-token chunk on top of it (causal mask, fully visible prefix: the kernel
    path) and 3 single-token greedy steps. Returns `[1, 15, vocab]`."""
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    cache = DynamicCache(config=model.config)
    logits = [model(ids[:, :8], **{CACHE_KWARG: cache}).logits, model(ids[:, 8:], **{CACHE_KWARG: cache}).logits]
    for _ in range(3):
        logits.append(model(logits[-1][:, -1:].argmax(-1), **{CACHE_KWARG: cache}).logits)
    return torch.cat(logits, dim=1)


# Two trees over the same number of nodes, one per batch row; node 0 is the root.
PARENTS = [[-1, 0, 0, 1, 1, 2, 4, 0], [-1, 0, 1, 2, 0, 4, 4, 6]]


def tree_inputs(parents: list[list[int]], prefix_len: int, blocked_prefix_column: int | None = None):
    """position_ids `[B, T]` (prefix_len + depth) and the additive mask `[B, 1, T, prefix_len + T]`: the prefix
    visible (except `blocked_prefix_column`, if given), the tree block by ancestry."""
    B, T = len(parents), len(parents[0])
    min_value = torch.finfo(torch.float32).min
    depth = torch.zeros(B, T, dtype=torch.long)
    mask = torch.full((B, 1, T, prefix_len + T), min_value)
    mask[..., :prefix_len] = 0
    for b, row in enumerate(parents):
        for i, p in enumerate(row):
            if p >= 0:
                depth[b, i] = depth[b, p] + 1
                mask[b, 0, i, prefix_len:] = mask[b, 0, p, prefix_len:]
            mask[b, 0, i, prefix_len + i] = 0
    if blocked_prefix_column is not None:
        mask[..., blocked_prefix_column] = min_value
    return (prefix_len + depth).to(DEVICE), mask.to(DEVICE)


def tree_forward(blocked_prefix_column: int | None = None):
    """A 10-token batched prefill, then one forward of a tree per row. Returns `[2, T, vocab]` tree logits."""

    def forward(model):
        gen = torch.Generator().manual_seed(2)
        prompt = torch.randint(0, 128, (2, 10), generator=gen).to(DEVICE)
        nodes = torch.randint(0, 128, (2, len(PARENTS[0])), generator=gen).to(DEVICE)
        cache = DynamicCache(config=model.config)
        model(prompt, **{CACHE_KWARG: cache})
        position_ids, mask = tree_inputs(PARENTS, 10, blocked_prefix_column)
        return model(nodes, position_ids=position_ids, attention_mask=mask, **{CACHE_KWARG: cache}).logits

    return forward


def test_register_is_idempotent():
    assert attention.register() == attention.register() == "lookahead_tree"
    assert AttentionInterface._global_mapping["lookahead_tree"] is attention.tree_attention_forward
    assert "lookahead_tree" in AttentionMaskInterface._global_mapping


def test_prefill_and_decode_match_sdpa(model, kernel_calls):
    expected = run_with(model, "sdpa", chunked_prefill_then_decode)
    logits = run_with(model, attention.register(), chunked_prefill_then_decode)
    assert kernel_calls == [4, 4]  # the 4-token chunk, in both layers; prefill and decode steps ran SDPA
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)


def test_tree_forward_matches_sdpa(model, kernel_calls):
    expected = run_with(model, "sdpa", tree_forward())
    logits = run_with(model, attention.register(), tree_forward())
    assert kernel_calls == [8, 8]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)


def test_masked_prefix_runs_sdpa(model, kernel_calls):
    expected = run_with(model, "sdpa", tree_forward(blocked_prefix_column=3))
    logits = run_with(model, attention.register(), tree_forward(blocked_prefix_column=3))
    assert kernel_calls == []
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU default")
def test_cpu_runs_sdpa_unless_forced(model, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the kernel ran on CPU without FORCE_KERNEL")

    monkeypatch.setattr(lookahead.kernels, "tree_attention", fail)
    expected = run_with(model, "sdpa", tree_forward())
    torch.testing.assert_close(run_with(model, attention.register(), tree_forward()), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU path")
def test_cpu_tree_forward_attends_grouped_without_copying_heads(model, monkeypatch):
    """A masked CPU forward of a grouped-query model runs SDPA with enable_gqa on the key/value heads as they are
    (no repeat_kv), and gives SDPA's logits."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def spy(query, key, *args, **kwargs):
        calls.append((query.shape[1], key.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(query, key, *args, **kwargs)

    expected = run_with(model, "sdpa", tree_forward())
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    logits = run_with(model, attention.register(), tree_forward())
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    assert calls[-2:] == [(4, 2, True)] * 2  # the tree forward, both layers: 4 query heads on 2 key/value heads


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU path")
def test_cpu_decoding_step_calls_grouped_sdpa_directly_with_sdpas_numbers(model, monkeypatch):
    """A one-row unmasked CPU step (plain decoding) calls SDPA with enable_gqa itself, skipping transformers'
    wrapper, and its logits are transformers' SDPA logits bit for bit (the unmasked prefill, off the compiled prefill
    kernel here, still goes through the wrapper, which passes is_causal; the 4-row chunk has a mask and takes the
    grouped path as before)."""
    monkeypatch.setattr(attention, "PREFILL_KERNEL", False)
    expected = run_with(model, "sdpa", chunked_prefill_then_decode)
    wrapper_rows = []
    wrapper = attention.sdpa_attention_forward

    def spy(module, query, *args, **kwargs):
        wrapper_rows.append(query.shape[2])
        return wrapper(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    logits = run_with(model, attention.register(), chunked_prefill_then_decode)
    assert torch.equal(logits, expected)
    assert wrapper_rows == [8, 8]  # the prefill, both layers; the 3 one-row steps called SDPA directly


def test_tree_attention_switches_sdpa_models_and_restores_them(model):
    with attention.tree_attention(model, "auto") as on:
        assert on and model.config._attn_implementation == "lookahead_tree"
    assert model.config._attn_implementation == "sdpa"
    with attention.tree_attention(model, "sdpa") as on:
        assert not on and model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    try:
        with attention.tree_attention(model, "auto") as on:  # a model the user set to eager stays eager
            assert not on and model.config._attn_implementation == "eager"
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the refusal without CUDA")
def test_triton_attention_without_cuda_is_a_clear_error(model, monkeypatch):
    from lookahead import LookaheadConfig

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device"), attention.tree_attention(model, "triton"):
        pass
    with pytest.raises(ValueError, match="attention must be one of"):
        LookaheadConfig(attention="flash")


def test_lookahead_decoding_through_the_kernel_gives_plain_greedy_tokens(model, kernel_calls):
    """End to end: lookahead's verification forwards run the Triton kernel (interpreted on CPU) and the greedy
    tokens equal plain SDPA greedy decoding."""
    from lookahead import Lookahead, LookaheadConfig

    head = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    prompt = torch.cat([head, head[:, :6]], dim=1).to(DEVICE)  # repetition gives prompt lookup drafts
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=24, do_sample=False)
    config = LookaheadConfig(adaptive=False, tree_budget=8, window_levels=1, window_columns=3)
    decoder = Lookahead(config)
    fast = run_with(model, attention.register(), lambda m: m.generate(
        prompt, max_new_tokens=24, do_sample=False, custom_generate=decoder))
    assert torch.equal(fast, plain)
    assert kernel_calls and max(kernel_calls) > 1  # multi-row verification forwards took the kernel path
