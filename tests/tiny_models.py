"""Tiny random decoder-only models built from configs in-process (no downloads), for exactness tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def tiny_model(family: str = "llama", dtype: torch.dtype = torch.float64, seed: int = 0, vocab: int = 64,
               layers: int = 2):
    """A randomly initialised `family` causal LM (hidden 32, 4 heads, 2 KV heads) in eval mode.

    Token ids of special tokens are None so only `max_new_tokens` or an explicit `eos_token_id` stop it.
    """
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def repetitive_prompt(seed: int, vocab: int = 64, length: int = 24) -> torch.Tensor:
    """[1, L] random prompt whose second half repeats part of the first (so prompt lookup finds matches)."""
    generator = torch.Generator().manual_seed(seed)
    head = torch.randint(0, vocab, (1, length // 2 + 4), generator=generator)
    return torch.cat([head, head[:, : length // 2 - 4]], dim=1)
