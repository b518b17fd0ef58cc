"""The drafters of one generation: prompt lookup and the n-gram pool (fed as text grows), token recycling (fed
by the verification logits), a learned head (fed the target's hidden state of the row that chose the root), an
optional cross-request drafter and an optional draft model; their candidates merged into one `DraftTree`."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from .config import LookaheadConfig
from .draft_head import DraftHead
from .draft_noise import DraftNoise
from .draft_model import NO_CHAIN, ModelDrafter
from .ngram_pool import NGramPool
from .prompt_lookup import PromptLookup
from .recycle import NO_NOISE, RecycleDrafter, RecycleTable, RowTops, top_k
from .recycle_prior import RecyclePrior
from .tree import DraftTree
from .verify import SampledDrafts

# DraftTree.source indexes these. Prompt lookup is split by suffix-match length (1, 2, 3+ tokens) and token
# recycling by the node's class under its parent (a confident top-1, another top-1, second, third and later:
# `recycle.py`), once for nodes from a token's row (RECYCLE), once for nodes from a verified token pair's row
# (RECYCLE_PAIR, `recycle_pairs.py`) and once from a pair's row seeded by the prior (RECYCLE_SEEDED; replayed on
# the suite, verified pair rows were right 44-88% of the time, seeded ones 12-40%, token rows 0-28%), because
# acceptance depends strongly on all of these; the learned head's proposals by their place and
# confidence (`HEAD_CONFIDENT`): a confident first, another first, second, third and later. The planner keeps one
# running estimate per source and depth.
SOURCE_DRAFTER = ("prompt", "prompt", "prompt", "pool", "shared", "draft_model",
                  "recycle", "recycle", "recycle", "recycle", "head", "head", "head", "head",
                  "recycle", "recycle", "recycle", "recycle", "recycle", "recycle", "recycle", "recycle")
PROMPT, POOL, SHARED, DRAFT_MODEL, RECYCLE, HEAD, RECYCLE_PAIR, RECYCLE_SEEDED = 0, 3, 4, 5, 6, 10, 14, 18
PROMPT_SOURCES, RECYCLE_SOURCES, HEAD_SOURCES = 3, 4, 4
# The head's first proposal is "confident" at this probability or more. Measured with the default model's head on
# the suite's first 4 prompts per category (their 96-token greedy outputs): where its top-1 held at least 0.5 (46%
# of positions) it was the model's next token 51% of the time (chat 56%, code 60%), elsewhere 13%.
HEAD_CONFIDENT = 0.5


def _recycle_sources(ranks: np.ndarray) -> list[int]:
    """The sources of recycled nodes from their classes (`RecycleDrafter.propose`: C + class for a node from a
    verified pair's row, 2C + class from a seeded one; C = RECYCLE_SOURCES)."""
    kind, classes = np.divmod(np.asarray(ranks, dtype=np.int64), RECYCLE_SOURCES)
    return (np.array([RECYCLE, RECYCLE_PAIR, RECYCLE_SEEDED])[kind] + classes).tolist()


class SharedDrafter(Protocol):
    """A drafter that outlives one generation (e.g. the server's cross-request suffix cache)."""

    def propose(self, text: np.ndarray, max_candidates: int, max_len: int) -> list[np.ndarray]:
        """Continuations of `text` ([n] int64, committed text ending with the root), best first."""


class Drafters:
    """Proposes candidate continuations of the root and learns from committed text, window n-grams and the
    verified rows' logits."""

    def __init__(self, config: LookaheadConfig, vocab_size: int, context: np.ndarray,
                 shared: SharedDrafter | None = None, model_drafter: ModelDrafter | None = None,
                 recycle_table: RecycleTable | None = None, head: DraftHead | None = None,
                 recycle_prior: RecyclePrior | None = None):
        """context: [n] int64, the prompt (committed text so far); shared: optional cross-request drafter;
        model_drafter: optional draft model (its chain is ranked first); recycle_table: a token-recycling table
        shared with other generations (None: a private one; unused when `config.recycle_nodes` is 0); head: a
        learned head (None or `config.head_candidates` 0: none); recycle_prior: seeds the table's empty rows."""
        self.config, self.shared, self.model_drafter = config, shared, model_drafter
        self._chain = NO_CHAIN  # the draft model's chain of the current step
        self.prompt = PromptLookup(max_ngram=config.prompt_max_ngram, min_ngram=config.prompt_min_ngram) \
            if config.prompt_candidates else None
        self.pool = NGramPool(n=config.pool_ngram_size, max_keys=config.pool_max_keys,
                              per_key=config.pool_per_key, vocab_size=vocab_size) \
            if config.pool_candidates else None
        self.recycle = RecycleDrafter(recycle_table, vocab_size, config.recycle_k, config.recycle_nodes,
                                      config.max_draft_len, recycle_prior, config.recycle_pairs) \
            if config.recycle_nodes else None
        self.head = head if config.head_candidates else None
        self._hidden: torch.Tensor | None = None  # the target's hidden state of the row that chose the root
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

    def recycle_rows(self, tokens: np.ndarray, logits: torch.Tensor, order: np.ndarray | None = None,
                     prev: np.ndarray | None = None, tops: RowTops | None = None) -> None:
        """Feed token recycling with verified rows: `tokens` [n] int64 the token each row carries, `logits`
        [n, V] their raw logits, `prev` [n] int64 the token before each row's (None: unknown), `order` the rows
        to store in order (None = all; the accepted path last), `tops` the logits' `row_tops` (None: computed)."""
        if self.recycle is not None:
            self.recycle.observe(tokens, logits, order, prev, tops)

    def row_tops(self, logits: torch.Tensor) -> RowTops | None:
        """The top-k token recycling reads from verified rows' raw logits [n, V] (computed once, also for the
        greedy walk: their first column is each row's argmax: `verify.argmax_of`), or None when nothing is recycled."""
        return None if self.recycle is None else top_k(logits, self.recycle.tops_k(logits))

    def recycle_tree(self, tree: DraftTree, logits: torch.Tensor, order: np.ndarray, before_root: int,
                     tops: RowTops | None = None) -> None:
        """`recycle_rows` for a verified tree's rows (`order` as there): each row's previous token is its parent's,
        the root's is `before_root` (-1: unknown); derived only when pair rows are kept."""
        prev = None
        if self.recycle is not None and self.config.recycle_pairs:
            prev = np.where(tree.parents >= 0, tree.tokens[np.maximum(tree.parents, 0)], before_root)
        self.recycle_rows(tree.tokens, logits, order, prev, tops)

    def observe_hidden(self, hidden: torch.Tensor | None) -> None:
        """Remember the target's final normed hidden state [size] of the row that chose the current root (None:
        unknown; the head then rests until it is told one)."""
        self._hidden = hidden if self.head is not None else None

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
            if self._hidden is not None:
                self._head_paths(root, max_len, estimates, paths, sources)
            if self.recycle is not None:
                keys, inv_temp = (NO_NOISE, 1.0) if noise is None else (noise.keys, noise.inv_temp)
                before = int(self._text[-2]) if len(self._text) >= 2 else -1
                found, ranks = self.recycle.propose(root, self._recycle_value(estimates), max_len, keys, inv_temp,
                                                    before, *self._pair_values(estimates))
                paths += found
                sources += _recycle_sources(ranks)
        return DraftTree.from_paths(root, paths, sources, budget=sum(len(p) for p in paths))

    def _head_paths(self, root: int, max_len: int, estimates: np.ndarray | None, paths: list, sources: list) -> None:
        """Append the head's proposals after `root` to `paths` / `sources`: each proposed token alone (source: the
        head class of its place and confidence) and, when recycling runs, the recycled subtree grown below its first
        proposal (its nodes keep their recycling classes, valued from depth 2 on). Subtrees below the others were
        measured not to pay: chat, 4 prompts, 96 tokens: 1.50 tokens per step with or without them, ~0.06 ms more
        drafting a step with them."""
        proposal = self.head.propose(self._hidden, root, self.config.head_candidates)
        value = None if self.recycle is None or max_len < 2 else self._recycle_value(estimates)[1:]
        value = value if value is not None and len(value) else None
        pair_values = None if value is None else [v[1:] for v in self._pair_values(estimates)]
        for place, token in enumerate(proposal.tokens.tolist()):
            confident = place == 0 and proposal.probs[0] >= HEAD_CONFIDENT
            paths.append(np.array([token], dtype=np.int64))
            sources.append(HEAD + (0 if confident else min(place + 1, HEAD_SOURCES - 1)))
            if value is not None and place == 0:
                found, ranks = self.recycle.propose(token, value, max_len - 1, NO_NOISE, 1.0, root, *pair_values)
                paths += [np.concatenate([[token], p]) for p in found]
                sources += _recycle_sources(ranks)

    def _recycle_value(self, estimates: np.ndarray | None, first: int = RECYCLE) -> np.ndarray:
        """[D, RECYCLE_SOURCES] conditional acceptance of a recycled node by depth and class (`recycle`: 0 a
        confident top-1 prediction, 1 another top-1, then by place), from the planner's per-source estimates
        [n_sources, D] of the sources from `first` on (RECYCLE: nodes from a token's row; RECYCLE_PAIR: from a
        pair's row) (None: 0.5 / (class + 1) at every depth)."""
        classes = np.arange(RECYCLE_SOURCES)
        if estimates is None:
            return np.tile(0.5 / (1.0 + classes), (self.config.max_draft_len, 1))
        return estimates[first + classes].T

    def _pair_values(self, estimates: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """`_recycle_value` of nodes from verified and from seeded pair rows."""
        return self._recycle_value(estimates, RECYCLE_PAIR), self._recycle_value(estimates, RECYCLE_SEEDED)

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
