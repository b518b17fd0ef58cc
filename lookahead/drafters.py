"""The drafters of one generation: prompt lookup and the n-gram pool (fed as text grows), token recycling (fed
by the verification logits), an optional cross-request drafter and an optional draft model; their candidates
merged into one `DraftTree`."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from .config import LookaheadConfig
from .draft_noise import DraftNoise
from .draft_model import NO_CHAIN, ModelDrafter
from .ngram_pool import NGramPool
from .prompt_lookup import PromptLookup
from .recycle import NO_NOISE, RecycleDrafter, RecycleTable
from .tree import DraftTree
from .verify import SampledDrafts

# DraftTree.source indexes these. Prompt lookup is split by suffix-match length (1, 2, 3+ tokens) and token
# recycling by the node's top-k rank under its parent (0, 1, 2, 3+), because acceptance depends strongly on
# both; the planner keeps one running estimate per source and depth.
SOURCE_DRAFTER = ("prompt", "prompt", "prompt", "pool", "shared", "draft_model",
                  "recycle", "recycle", "recycle", "recycle")
PROMPT, POOL, SHARED, DRAFT_MODEL, RECYCLE = 0, 3, 4, 5, 6
PROMPT_SOURCES, RECYCLE_SOURCES = 3, 4


class SharedDrafter(Protocol):
    """A drafter that outlives one generation (e.g. the server's cross-request suffix cache)."""

    def propose(self, text: np.ndarray, max_candidates: int, max_len: int) -> list[np.ndarray]:
        """Continuations of `text` ([n] int64, committed text ending with the root), best first."""


class Drafters:
    """Proposes candidate continuations of the root and learns from committed text, window n-grams and the
    verified rows' logits."""

    def __init__(self, config: LookaheadConfig, vocab_size: int, context: np.ndarray,
                 shared: SharedDrafter | None = None, model_drafter: ModelDrafter | None = None,
                 recycle_table: RecycleTable | None = None):
        """context: [n] int64, the prompt (committed text so far); shared: optional cross-request drafter;
        model_drafter: optional draft model (its chain is ranked first); recycle_table: a token-recycling table
        shared with other generations (None: a private one; unused when `config.recycle_nodes` is 0)."""
        self.config, self.shared, self.model_drafter = config, shared, model_drafter
        self._chain = NO_CHAIN  # the draft model's chain of the current step
        self.prompt = PromptLookup(max_ngram=config.prompt_max_ngram, min_ngram=config.prompt_min_ngram) \
            if config.prompt_candidates else None
        self.pool = NGramPool(n=config.pool_ngram_size, max_keys=config.pool_max_keys,
                              per_key=config.pool_per_key, vocab_size=vocab_size) \
            if config.pool_candidates else None
        self.recycle = RecycleDrafter(recycle_table, vocab_size, config.recycle_k, config.recycle_nodes,
                                      config.max_draft_len) if config.recycle_nodes else None
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

    def recycle_rows(self, tokens: np.ndarray, logits: torch.Tensor, order: np.ndarray | None = None) -> None:
        """Feed token recycling with verified rows: `tokens` [n] int64 the token each row carries, `logits`
        [n, V] their raw logits, `order` the rows to store in order (None = all; the accepted path last)."""
        if self.recycle is not None:
            self.recycle.observe(tokens, logits, order)

    def draft(self, root: int, max_len: int, chain_len: int | None = None,
              estimates: np.ndarray | None = None, noise: DraftNoise | None = None) -> DraftTree:
        """Merge every drafter's candidates (each cut to `max_len` tokens) into one unpruned `DraftTree` for
        `root`; the draft model's chain has `chain_len` tokens (None: `config.draft_tokens`; 0: the draft model
        rests). `estimates` [n_sources, D]: the planner's conditional acceptance per source and depth, which
        shapes the recycled draft (None: a fixed prior). `noise`: the seeded rule's noise after the root, which
        orders the recycled children as the seeded draw would (None: by the target's top-k order). The caller
        ranks and prunes the tree."""
        paths, sources = [], []
        self._chain = NO_CHAIN
        if max_len > 0 and self.config.tree_budget > 0:
            chain_len = self.config.draft_tokens if chain_len is None else chain_len
            if self.model_drafter is not None and chain_len > 0:
                self._chain = self.model_drafter.propose(self._text, min(max_len, chain_len))
                paths.append(self._chain.tokens)
                sources.append(DRAFT_MODEL)
            if self.prompt is not None:
                found = self.prompt.propose(self.config.prompt_candidates, max_len)
                paths += found.paths
                sources += [PROMPT + min(int(k), PROMPT_SOURCES) - 1 for k in found.match_lengths]
            if self.pool is not None:
                found = self.pool.lookup(root, self.config.pool_candidates)
                paths += [p[:max_len] for p in found]
                sources += [POOL] * len(found)
            if self.shared is not None and self.config.shared_candidates:
                found = self.shared.propose(self._text, self.config.shared_candidates, max_len)
                paths += found
                sources += [SHARED] * len(found)
            if self.recycle is not None:
                keys, inv_temp = (NO_NOISE, 1.0) if noise is None else (noise.keys, noise.inv_temp)
                found, ranks = self.recycle.propose(root, self._recycle_value(estimates), max_len, keys, inv_temp)
                paths += found
                sources += (RECYCLE + np.minimum(ranks, RECYCLE_SOURCES - 1)).tolist()  # ranks: the classes
        return DraftTree.from_paths(root, paths, sources, budget=sum(len(p) for p in paths))

    def _recycle_value(self, estimates: np.ndarray | None) -> np.ndarray:
        """[D, RECYCLE_SOURCES] conditional acceptance of a recycled node by depth and class (`recycle`: 0 a
        confident top-1 prediction, 1 another top-1, then by place), from the planner's per-source estimates
        [n_sources, D] (None: 0.5 / (class + 1) at every depth)."""
        classes = np.arange(RECYCLE_SOURCES)
        if estimates is None:
            return np.tile(0.5 / (1.0 + classes), (self.config.max_draft_len, 1))
        return estimates[RECYCLE + classes].T

    def sampled_drafts(self, tree: DraftTree) -> SampledDrafts:
        """The draft model's sampled chain as it survives in `tree` (e.g. after pruning): {parent node: (chain
        token, the q it was sampled from)}. Empty when the chain was picked deterministically or not drafted."""
        out: SampledDrafts = {}
        node = 0
        for token, q in zip(self._chain.tokens.tolist(), self._chain.probs):
            child = tree.children[node].get(token)
            if q is None or child is None:
                break
            out[node] = (token, q)
            node = child
        return out
