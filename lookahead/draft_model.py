"""The external draft model as a drafter: a small causal LM with the target's vocabulary proposes one chain per
step, keeping its own KV cache, which is rolled back to the committed text before each proposal.

Also: the vocabulary checks that refuse an incompatible draft, and `early_exit_draft`, a self-speculative draft
made of the target's own first layers plus its final norm and LM head (weights shared, nothing copied).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from .cache import common_prefix
from .compat import CACHE_KWARG
from .distributed import leader_value

# (processed draft scores [V], absolute sequence index of the drafted token) -> (token, q or None).
# q is the distribution the token was sampled from (sampled mode); None for a deterministic pick.
DraftPick = Callable[[torch.Tensor, int], tuple[int, "torch.Tensor | None"]]
# (token ids [n] of the context, raw logits [V] after it) -> processed scores [V]
Process = Callable[[np.ndarray, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DraftChain:
    """A chain the draft model proposed: `tokens` [k] int64 and, per token, the distribution q [V] it was sampled
    from (`probs`; None for a deterministic pick)."""

    tokens: np.ndarray
    probs: tuple[torch.Tensor | None, ...] = ()


NO_CHAIN = DraftChain(np.zeros(0, dtype=np.int64))


class ModelDrafter:
    """Proposes a chain of up to `length` tokens from `model`, continuing the committed text.

    pick: chooses each draft token from the draft's processed scores (argmax, a sample from q, or the seeded
    Gumbel-max draw); process: applies the generation config's logits processors to the draft's logits with the
    draft's own prefix (so q resembles the target's processed distribution), or None; skip: leading
    committed tokens the draft never sees (left padding).
    """

    def __init__(self, model, length: int, pick: DraftPick, process: Process | None = None, skip: int = 0):
        self.model, self.length, self.pick, self.process, self.skip = model, length, pick, process, skip
        self.cache = DynamicCache()
        self.cached = np.zeros(0, dtype=np.int64)  # the tokens whose K/V the draft cache holds, in order
        self.seconds_per_token: float | None = None  # running mean time to draft one token

    @torch.no_grad()
    def propose(self, text: np.ndarray, max_len: int) -> DraftChain:
        """A chain continuing `text` ([n] int64, the committed text ending with the root) of at most
        `min(length, max_len)` tokens, with the q each token was sampled from."""
        n = min(self.length, max_len)
        if n <= 0:
            return NO_CHAIN
        start = time.perf_counter()
        visible = text[self.skip:]
        keep = min(common_prefix(self.cached, visible), len(visible) - 1)  # feed at least the root
        self._rollback(keep)
        logits = self._forward(visible[keep:])
        chain: list[int] = []
        probs: list[torch.Tensor | None] = []
        for i in range(n):
            token, q = self.pick(self._scores(text, chain, logits), len(text) + i)
            chain.append(token)
            probs.append(q)
            if i + 1 < n:
                logits = self._forward(np.asarray([token], dtype=np.int64))
        self.cached = np.concatenate([visible, np.asarray(chain[:-1], dtype=np.int64)])
        seconds = leader_value((time.perf_counter() - start) / n)  # tensor-parallel ranks: rank 0's speed
        self.seconds_per_token = seconds if self.seconds_per_token is None else \
            0.8 * self.seconds_per_token + 0.2 * seconds
        return DraftChain(np.asarray(chain, dtype=np.int64), tuple(probs))

    def _rollback(self, keep: int) -> None:
        """Drop cached slots beyond the first `keep` (the rejected part of the last chain)."""
        surplus = self.cache.get_seq_length() - keep
        if surplus > 0:
            self.cache.crop(-surplus)
        self.cached = self.cached[:keep]

    def _forward(self, tokens: np.ndarray) -> torch.Tensor:
        """Append `tokens` to the draft cache; returns the raw logits [V] after the last one."""
        ids = torch.from_numpy(tokens).to(self.model.device).view(1, -1)
        out = self.model(input_ids=ids, **{CACHE_KWARG: self.cache}, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def _scores(self, text: np.ndarray, chain: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The draft's processed scores [V] (float32) at the node `text + chain`."""
        if self.process is None:
            return logits.float()
        return self.process(np.concatenate([text, np.asarray(chain, dtype=np.int64)]), logits)


def check_draft_model(target, draft) -> None:
    """Raise `ValueError` unless `draft` is a decoder-only generative model with the target's vocabulary size."""
    if getattr(draft.config, "is_encoder_decoder", False) or not hasattr(draft, "can_generate") \
            or not draft.can_generate():
        raise ValueError(f"the draft model must be a decoder-only causal LM, got {type(draft).__name__}")
    target_vocab = target.config.get_text_config().vocab_size
    draft_vocab = draft.config.get_text_config().vocab_size
    if target_vocab != draft_vocab:
        raise ValueError(f"draft model vocabulary mismatch: the target has {target_vocab} tokens, the draft "
                         f"{draft_vocab}; a draft model must use the target's tokenizer")


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """Raise `ValueError` naming the first differing entry unless both tokenizers map the same tokens to the
    same ids."""
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    only_target = sorted(set(target_vocab) - set(draft_vocab))
    only_draft = sorted(set(draft_vocab) - set(target_vocab))
    moved = sorted(t for t in set(target_vocab) & set(draft_vocab) if target_vocab[t] != draft_vocab[t])
    if moved:
        detail = f"token {moved[0]!r} is id {target_vocab[moved[0]]} in the target, {draft_vocab[moved[0]]} " \
                 "in the draft"
    elif only_target:
        detail = f"token {only_target[0]!r} is missing from the draft ({len(only_target)} missing)"
    else:
        detail = f"token {only_draft[0]!r} is not in the target ({len(only_draft)} extra)"
    raise ValueError(f"draft model vocabulary mismatch: {detail}; a draft model must use the target's tokenizer")


def early_exit_draft(model, layers: int):
    """A self-speculative draft: `model`'s first `layers` decoder layers, its final norm and its LM head.

    The modules are shared with `model` (no weights copied). Needs a Llama-style model (`model.model.layers`,
    `.embed_tokens`, `.norm`, `.lm_head`); raises `ValueError` otherwise or if `layers` is not in
    [1, number of layers).
    """
    inner = getattr(model, "model", None)
    parts = ("layers", "embed_tokens", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, p) for p in parts) or not hasattr(model, "lm_head"):
        raise ValueError(f"an early-exit draft needs a Llama-style model, got {type(model).__name__}")
    total = len(inner.layers)
    if not 1 <= layers < total:
        raise ValueError(f"draft layers must be in [1, {total - 1}] for this {total}-layer model, got {layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        draft = type(model)(config)
    draft.model.embed_tokens, draft.model.norm = inner.embed_tokens, inner.norm
    draft.model.rotary_emb, draft.lm_head = inner.rotary_emb, model.lm_head
    draft.model.layers = torch.nn.ModuleList(inner.layers[:layers])
    draft.generation_config = copy.deepcopy(model.generation_config)
    left = [name for name, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"cannot build an early-exit draft of {type(model).__name__}: {left[0]} is not shared")
    return draft.eval()
