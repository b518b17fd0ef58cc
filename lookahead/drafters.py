"""The drafters of one generation: prompt lookup and the n-gram pool (fed as text grows), an optional
cross-request drafter and an optional draft model; their candidates merged into one `DraftTree`."""

from __future__ import annotations

import numpy as np

from typing import Protocol

from .config import LookaheadConfig
from .draft_model import ModelDrafter
from .ngram_pool import NGramPool
from .prompt_lookup import PromptLookup
from .sampling import SampledDrafts
from .tree import DraftTree

# DraftTree.source indexes these: prompt lookup is split by suffix-match length (1, 2, 3+ tokens) because
# its acceptance rate depends strongly on it, and the budget keeps one running rate per source.
SOURCE_DRAFTER = ("prompt", "prompt", "prompt", "pool", "shared", "draft_model")
PROMPT, POOL, SHARED, DRAFT_MODEL = 0, 3, 4, 5
PROMPT_SOURCES = 3


class SharedDrafter(Protocol):
    """A drafter that outlives one generation (e.g. the server's cross-request suffix cache)."""

    def propose(self, text: np.ndarray, max_candidates: int, max_len: int) -> list[np.ndarray]:
        """Continuations of `text` ([n] int64, committed text ending with the root), best first."""


class Drafters:
    """Proposes candidate continuations of the root and learns from committed text and window n-grams."""

    def __init__(self, config: LookaheadConfig, vocab_size: int, context: np.ndarray,
                 shared: SharedDrafter | None = None, model_drafter: ModelDrafter | None = None):
        """context: [n] int64, the prompt (committed text so far); shared: optional cross-request drafter;
        model_drafter: optional draft model (its chain is ranked first)."""
        self.config, self.shared, self.model_drafter = config, shared, model_drafter
        self._chain = np.zeros(0, dtype=np.int64)
        self.prompt = PromptLookup(max_ngram=config.prompt_max_ngram, min_ngram=config.prompt_min_ngram) \
            if config.prompt_candidates else None
        self.pool = NGramPool(n=config.pool_ngram_size, max_keys=config.pool_max_keys,
                              per_key=config.pool_per_key, vocab_size=vocab_size) \
            if config.pool_candidates else None
        self._text_len = 0
        self.observe(context)  # sets self._text

    def observe(self, text: np.ndarray) -> None:
        """Learn the committed text `text` ([n] int64, the whole text so far; only the new tail is read)."""
        new = text[self._text_len:]
        if self.prompt is not None:
            self.prompt.extend(new)
        if self.pool is not None and self.config.pool_from_text:
            self.pool.add_text(text, start=self._text_len)
        self._text, self._text_len = text, len(text)

    def harvest(self, grams: np.ndarray) -> None:
        """Add window n-grams ([G, n] int64) to the pool."""
        if self.pool is not None and len(grams):
            self.pool.add(grams)

    def draft(self, root: int, max_len: int, chain_len: int | None = None) -> DraftTree:
        """Merge every drafter's candidates (each cut to `max_len` tokens) into a `DraftTree` for `root`; the
        draft model's chain has `chain_len` tokens (None: `config.draft_tokens`; 0: the draft model rests)."""
        paths, sources = [], []
        self._chain = np.zeros(0, dtype=np.int64)
        if self.model_drafter is not None:
            self.model_drafter.last_probs = []
        if max_len > 0 and self.config.tree_budget > 0:
            chain_len = self.config.draft_tokens if chain_len is None else chain_len
            if self.model_drafter is not None and chain_len > 0:
                self._chain = self.model_drafter.propose(self._text, min(max_len, chain_len))
                paths.append(self._chain)
                sources.append(DRAFT_MODEL)
            if self.prompt is not None:
                found = self.prompt.propose(self.config.prompt_candidates, max_len)
                paths += found
                sources += [PROMPT + min(int(k), PROMPT_SOURCES) - 1 for k in self.prompt.last_match_lengths]
            if self.pool is not None:
                found = self.pool.lookup(root, self.config.pool_candidates)
                paths += [p[:max_len] for p in found]
                sources += [POOL] * len(found)
            if self.shared is not None and self.config.shared_candidates:
                found = self.shared.propose(self._text, self.config.shared_candidates, max_len)
                paths += found
                sources += [SHARED] * len(found)
        return DraftTree.from_paths(root, paths, sources, self.config.tree_budget)

    def sampled_drafts(self, tree: DraftTree) -> SampledDrafts:
        """The draft model's sampled chain as it survives in `tree` (e.g. after pruning): {parent node: (chain
        token, the q it was sampled from)}. Empty when the chain was picked deterministically or not drafted."""
        out: SampledDrafts = {}
        node = 0
        probs = self.model_drafter.last_probs if self.model_drafter is not None else []
        for token, q in zip(self._chain.tolist(), probs):
            child = tree.children[node].get(token)
            if q is None or child is None:
                break
            out[node] = (token, q)
            node = child
        return out
