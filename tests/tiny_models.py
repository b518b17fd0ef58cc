"""Tiny random decoder-only models built from configs in-process (no downloads), test prompts and a word
tokenizer."""

from __future__ import annotations

import torch


FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
FAMILY_DEFAULTS = {"mistral": {"sliding_window": None}, "gemma": {"head_dim": 8},
                   "gemma3": {"head_dim": 8, "sliding_window": 16}}


def build_tiny_model(family: str = "llama", dtype: torch.dtype = torch.float64, seed: int = 0, vocab: int = 64,
                     layers: int = 2, **overrides) -> torch.nn.Module:
    """A freshly initialised tiny causal LM (`family` from FAMILIES or "gpt2") in eval mode with no special
    tokens (bos/eos/pad = None).

    `overrides` go to the config (e.g. `attn_implementation="eager"`). A larger-than-default initializer range
    makes attention and logits far from uniform, so a wrong mask or position changes the logits visibly.
    """
    import transformers  # here, not at the top: test files without models should not pay for the import

    if family == "gpt2":  # learned absolute positions: per-row position_ids matter
        config_cls, model_cls = transformers.GPT2Config, transformers.GPT2LMHeadModel
        kwargs = dict(vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, n_positions=1024,
                      initializer_range=0.1, bos_token_id=None, eos_token_id=None)
    else:
        config_cls, model_cls = (getattr(transformers, name) for name in FAMILIES[family])
        kwargs = dict(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
        )  # fmt: skip
    kwargs.update(FAMILY_DEFAULTS.get(family, {}))
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).to(dtype).eval()
    model.generation_config.bos_token_id = None
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


# Tiny fp32 Llama-style models whose layers the fused steps compute (`fused_layer.py`, `fused_stack.py`).
FUSED_ARCHITECTURES = {
    "llama": {},
    "qwen2": {},  # q/k/v with bias
    "llama-odd-width": {"intermediate_size": 100},  # gate/up padded to whole panels
    "llama-wide-heads": {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64},
    "llama-heads16": {"hidden_size": 64},  # heads of 16 floats: `decode_attention`'s kernel on AVX-512
    "qwen2-heads16": {"hidden_size": 64},
}


def fused_test_model(name: str, seed: int, **extra) -> torch.nn.Module:
    """A 3-layer fp32 model of FUSED_ARCHITECTURES[name] (a family name alone: its defaults) with `extra` config."""
    return build_tiny_model(name.split("-")[0], dtype=torch.float32, seed=seed, layers=3,
                            **{**FUSED_ARCHITECTURES.get(name, {}), **extra})


def assert_plain_greedy(model, decoder, seeds=range(3), tokens: int = 40) -> None:
    """Greedy generation with `decoder` (a `Lookahead`) equals plain greedy on `repetitive_prompt(seed)` for each
    seed, token for token."""
    for seed in seeds:
        prompt = repetitive_prompt(seed)
        plain = model.generate(prompt, do_sample=False, max_new_tokens=tokens)
        fast = model.generate(prompt, do_sample=False, max_new_tokens=tokens, custom_generate=decoder)
        assert torch.equal(plain, fast), seed


def repetitive_prompt(seed: int, vocab: int = 64, length: int = 24) -> torch.Tensor:
    """[1, L] random prompt whose second half repeats part of the first (so prompt lookup finds matches)."""
    generator = torch.Generator().manual_seed(seed)
    head = torch.randint(0, vocab, (1, length // 2 + 4), generator=generator)
    return torch.cat([head, head[:, : length // 2 - 4]], dim=1)


def word_tokenizer(vocab_size: int = 64):
    """A whitespace word tokenizer over the words w0..w{vocab_size-1} (w0 = unknown) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0")
    tokenizer.chat_template = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}w3"
    return tokenizer


def three_steps(model, prompt: torch.Tensor):
    """(logits of a prefill, of a one-token cached step and of a tree-masked verification step (two branches, 6
    rows), the compactable cache after them)."""
    from transformers import DynamicCache

    from lookahead.cache import make_compactable
    from lookahead.compat import CACHE_KWARG
    from lookahead.layout import pack
    from lookahead.tree import DraftTree

    cache = DynamicCache()  # no config: sliding-window layers keep every token, as lookahead needs
    outs = [model(prompt[:, :-1], **{CACHE_KWARG: cache}, use_cache=True).logits]
    make_compactable(cache, model.config, 4096)
    outs.append(model(prompt[:, -1:], **{CACHE_KWARG: cache}, use_cache=True).logits)
    prefix = prompt.shape[1]
    tree = DraftTree.from_paths(5, [[7, 9, 11], [8, 3]], [0, 0], 5)
    inputs = pack(tree, None, prefix, prefix, None, model.dtype, model.device)
    outs.append(model(input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                      attention_mask=inputs.attention_mask, **{CACHE_KWARG: cache}, use_cache=True).logits)
    return outs, cache
