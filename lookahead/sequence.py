"""`Sequence`: one member of a generation's batch — its committed text, drafters, window, acceptance
statistics, token rule, stop checks and the cache slots it may attend to."""

from __future__ import annotations

import numpy as np
import torch

from .budget import StepPlanner, expected_tokens
from .config import LookaheadConfig
from .draft_model import ModelDrafter
from .draft_noise import SeededDraftNoise, sampling_temperature
from .drafters import DRAFT_MODEL, POOL, SOURCE_DRAFTER, Drafters
from .jacobi import JacobiWindow
from .layout import SequenceDrafts
from .request import DecodeRequest
from .row_processors import run_row_warpers, scores_rows_alone
from .rules import SeededRule, make_rule
from .scores import ScoreRecord
from .stats import AcceptedDrafts
from .stop_checks import StopCheck
from .tree import DraftTree
from .verify import Verdict, argmax_of


class Sequence:
    """One sequence being generated (a member of the batch).

    index: its index in the request's batch; prompt: [L] int64 (left padding included); hidden: [L] bool
    prompt slots it must not attend to (None = all visible); root_position: the position id of the token
    after the prompt; request: the `DecodeRequest`; use_window: whether this sequence runs a Jacobi window
    (single-sequence generations only).
    """

    def __init__(self, index: int, prompt: np.ndarray, hidden: torch.Tensor | None, root_position: int,
                 config: LookaheadConfig, request: DecodeRequest, vocab_size: int, use_window: bool):
        self.index, self.config, self.request = index, config, request
        self.ids = np.zeros(request.max_length + config.max_draft_len + 1, dtype=np.int64)  # committed text
        self.ids[: len(prompt)] = prompt
        self.length, self.prompt_length = len(prompt), len(prompt)
        self.hidden, self.root_position = hidden, root_position
        self.stop_length: int | None = None  # length when the stopping criteria first fired
        self.rule = make_rule(request.do_sample, copy_seed(config.seed, index % request.copies),
                              request.draft_model is not None)
        self.record = ScoreRecord() if request.record_scores else None  # for output_scores / output_logits
        # The recycling table outlives the request when the caller shares one (a `Lookahead` object, a server).
        self.drafters = Drafters(config, vocab_size, prompt, request.shared_drafter, self._model_drafter(),
                                 request.recycle_table, request.draft_head, request.recycle_prior)
        self.window = JacobiWindow(config.window_levels, config.window_columns, config.seed or 0) \
            if use_window and config.window_size else None
        if self.window is not None:
            self.window.reset(prompt)
        self.planner = StepPlanner(request.cost_curve, len(SOURCE_DRAFTER),
                                   config.window_size if self.window is not None else 0)
        self._candidates: DraftTree | None = None
        self._noise: SeededDraftNoise | None = None  # seeded sampling with recycling: set once the vocabulary is known
        self._row_alone = scores_rows_alone(request.logits_processor)  # processors may run on this row alone
        self._stops = StopCheck(request.stopping_criteria, self._list_fires)

    def _model_drafter(self) -> ModelDrafter | None:
        """The draft model's drafter (None without a draft model); it skips the prompt's left padding."""
        if self.request.draft_model is None:
            return None
        skip = int(self.hidden.long().cumprod(0).sum()) if self.hidden is not None else 0
        process = self.process if self.has_processors else None
        return ModelDrafter(self.request.draft_model, self.config.draft_tokens, self.rule.propose, process, skip)

    @property
    def has_processors(self) -> bool:
        """Whether the generation config adds logits processors or warpers."""
        return len(self.request.logits_processor) > 0

    @property
    def new_tokens(self) -> int:
        """Tokens generated so far."""
        return self.length - self.prompt_length

    @property
    def root(self) -> int:
        """The last committed token, which every step's forward starts with."""
        return int(self.ids[self.length - 1])

    def candidates(self) -> DraftTree:
        """Every drafter's candidates for this step merged into one tree, ranked by the planner's estimates and
        cut to `tree_budget` nodes (the unpruned tree is kept for `learn`)."""
        root = self.root
        drafter = self.drafters.model_drafter
        chain = None if drafter is None else \
            self.planner.chain_length(DRAFT_MODEL, drafter.seconds_per_token, self.config.draft_tokens)
        noise = None if self._noise is None else self._noise.at(self.length - 1)
        self._candidates = self.drafters.draft(root, self.request.max_length - self.length - 1, chain,
                                               self.planner.rates.rates(), noise)
        return self.planner.rank(self._candidates).prune(self.config.tree_budget)

    def plain_tree(self) -> DraftTree:
        """The root alone: this step drafts nothing (the drafters rest) and the planner learns nothing from it."""
        self._candidates = None
        return DraftTree.from_paths(self.root, [], [], 0)

    def drafts(self, tree: DraftTree, use_window: bool) -> SequenceDrafts:
        """What this sequence verifies this step (`tree` is its planned, pruned tree)."""
        return SequenceDrafts(tree, self.window if use_window else None, self.root_position, self.hidden)

    def first_token(self, logits: torch.Tensor) -> int:
        """The token chosen by the rule from the prefill's last logits [V]."""
        self.drafters.recycle_rows(self.ids[self.length - 1: self.length], logits.view(1, -1),
                                   prev=self.ids[self.length - 2: self.length - 1] if self.length >= 2 else None)
        if isinstance(self.rule, SeededRule) and self.drafters.recycle is not None:
            self._noise = SeededDraftNoise(self.rule.seed, self.config.max_draft_len,
                                           sampling_temperature(self.request.logits_processor))
        scores = self.score([], logits) if self.has_processors else logits
        if self.record is not None:
            self.record.record(0, logits.view(1, -1), [scores])
        return self.rule.first(scores, self.length)

    def verify(self, tree: DraftTree, logits: torch.Tensor) -> Verdict:
        """Walk `tree` with the rule against its rows' raw logits [N, V]; then recycle every row's top-k
        (the accepted path last, so its true-context prediction is the one kept for a repeated token)."""
        scorer = self._node_scorer()
        if self.record is not None:
            scorer = self.record.remembering(scorer)
        tops = self.drafters.row_tops(logits)  # read once: recycled below, and its first column is the argmax
        verdict = self.rule.walk(tree, logits, scorer, root_index=self.length - 1,
                                 sampled=self.drafters.sampled_drafts(tree),
                                 argmax=None if tops is None else argmax_of(tops.indices, tops.nan_free))
        if self.record is not None:
            self.record.record_walk(self.new_tokens, verdict, logits)
        path = np.asarray(verdict.path, dtype=np.int64)
        others = np.ones(tree.size, dtype=bool)
        others[path] = False
        self.drafters.recycle_tree(tree, logits, np.concatenate([np.flatnonzero(others), path]),
                                   int(self.ids[self.length - 2]) if self.length >= 2 else -1, tops)
        return verdict

    def commit(self, tokens: list[int], limit: int, cut_at_stop: bool) -> list[int]:
        """Append `tokens` one by one up to length `limit`; returns the committed ones.

        The first time the stopping criteria fire, `stop_length` records the length (as plain decoding would
        stop this sequence there); with `cut_at_stop` nothing after that token is committed.
        """
        for i, token in enumerate(tokens):
            self.ids[self.length] = token
            self.length += 1
            if self.stop_length is None and self._criteria_fire():
                self.stop_length = self.length
                if cut_at_stop:
                    return tokens[: i + 1]
            if self.length >= limit:
                return tokens[: i + 1]
        return tokens

    def advance(self, tokens: list[int], used_window: bool, window_logits: torch.Tensor | None,
                prefix_len: int, slots: int) -> None:
        """After a step committed `tokens` into `slots` new cache slots after `prefix_len` (the slots beyond
        `len(tokens)` are holes): learn acceptance, move the root, iterate the window (if it ran) and feed the
        drafters."""
        if self._candidates is not None:
            self.planner.learn(self._candidates, tokens, used_window, POOL)
        self.root_position += len(tokens)
        holes = slots - len(tokens)
        if self.hidden is not None or holes:
            seen = self.hidden if self.hidden is not None else torch.zeros(prefix_len, dtype=torch.bool)
            self.hidden = torch.cat([seen, torch.zeros(len(tokens), dtype=torch.bool),
                                     torch.ones(holes, dtype=torch.bool)])
        if window_logits is not None:
            outputs = window_logits.argmax(dim=-1).cpu().numpy()
            self.drafters.harvest(self.window.advance(outputs, len(tokens), self.ids[: self.length]))
        self.drafters.observe(self.ids[: self.length])

    def accepted_sources(self, tree: DraftTree, verdict: Verdict, n_tokens: int) -> AcceptedDrafts:
        """The drafter of each accepted draft token among the first `n_tokens` committed, and the tokens the
        planner predicted verifying `tree` (ranked by it) would commit."""
        return AcceptedDrafts([SOURCE_DRAFTER[tree.source[n]] for n in verdict.path[1:n_tokens]],
                              expected_tokens(tree))

    def _criteria_fire(self) -> bool:
        """Whether HF's stopping criteria fire on the committed text."""
        return self._stops(self.ids[: self.length])

    def _list_fires(self, text: np.ndarray) -> bool:
        """Whether the stopping criteria list, called as `generate` calls it, fires on `text` [n] for this sequence."""
        return bool(self.request.stopping_criteria(self._batch_view(text), None)[self.index])

    def _node_scorer(self):
        """The per-node scorer for the rule's walk (None when raw logits are final)."""
        if self.has_processors:
            return self.score
        return None if not self.request.do_sample else (lambda path, row: row.float())

    def score(self, path: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Processed scores [V] of a node whose context is the committed text plus `path`."""
        return self.process(np.concatenate([self.ids[: self.length], np.asarray(path, dtype=np.int64)]), logits)

    def process(self, text: np.ndarray, logits: torch.Tensor) -> torch.Tensor:
        """The generation config's processors applied to `logits` [V] after the token ids `text` [n]: on this
        row alone when they allow it (`row_processors`), else on a batch of copies at this sequence's index."""
        ids = self._batch_view(text)
        if self._row_alone:
            ids = ids[self.index: self.index + 1].to(logits.device)
            return run_row_warpers(self.request.logits_processor, ids, logits.float().view(1, -1).clone())[0]
        scores = logits.float().view(1, -1).expand(ids.shape[0], -1).clone()
        return self.request.logits_processor(ids.to(logits.device), scores)[self.index]

    def _batch_view(self, ids: np.ndarray) -> torch.Tensor:
        """[B, n] ids for HF processors and criteria, which may keep per-sequence state (e.g. the repetition
        penalty's prompt padding lengths): this sequence's text at its batch index, copies elsewhere."""
        text = torch.from_numpy(ids).to(self.request.input_ids.device).view(1, -1)
        return text.expand(self.request.input_ids.shape[0], -1)


def copy_seed(seed: int | None, copy: int) -> int | None:
    """The seed of copy `copy` of a prompt (`num_return_sequences`): `seed` itself for copy 0, a distinct 64-bit
    seed for each other copy, so the copies are independent draws and a seeded run still reproduces itself."""
    if seed is None or copy == 0:
        return seed
    return (seed + copy * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)  # the Weyl step of splitmix64: distinct per copy
