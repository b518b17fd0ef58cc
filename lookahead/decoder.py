"""Prefill and the step loop: draft → pack → forward → verify → commit → update (batch size 1)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .budget import CostCurve, StepPlanner
from .cache import keep_rows
from .config import LookaheadConfig
from .draft_model import ModelDrafter
from .drafters import POOL, SOURCE_DRAFTER, Drafters
from .jacobi import JacobiWindow
from .layout import pack
from .stats import DecodeStats
from .tree import DraftTree
from .rules import make_rule
from .verify import Verdict


@dataclass
class DecodeRequest:
    """What one decoding run needs from `generate` (all prepared by transformers).

    input_ids: [1, L] prompt; prompt_kwargs: the model kwargs for the prefill forward (cache, attention mask,
    position ids, ...); logits_processor / stopping_criteria: HF lists; max_length: prompt + new tokens cap;
    streamer: optional HF streamer that receives committed tokens; shared_drafter: optional cross-request drafter
    (see `drafters.SharedDrafter`); cost_curve: the model's measured cost curve (None = verify the whole tree and
    window every step); do_sample: sample instead of greedy; draft_model: optional small causal LM with the
    target's vocabulary (checked by the caller) that drafts a chain each step.
    """

    input_ids: torch.Tensor
    prompt_kwargs: dict
    logits_processor: object
    stopping_criteria: object
    max_length: int
    streamer: object = None
    shared_drafter: object = None
    cost_curve: CostCurve | None = None
    do_sample: bool = False
    draft_model: object = None


class Decoder:
    """Runs one lookahead generation for one request; `run()` returns the full sequence [1, L + new]."""

    def __init__(self, model, config: LookaheadConfig, request: DecodeRequest):
        self.model, self.config, self.request = model, config, request
        self.cache = request.prompt_kwargs["past_key_values"]  # checked compactable at the boundary (hf.py)
        prompt = request.input_ids[0].cpu().numpy()
        self.ids = np.zeros(request.max_length + config.max_draft_len + 1, dtype=np.int64)  # committed text
        self.ids[: len(prompt)] = prompt
        self.length = len(prompt)
        self.stats = DecodeStats()
        self.rule = make_rule(request.do_sample, config.seed)
        self.prefix_hidden = _hidden_slots(request.prompt_kwargs.get("attention_mask"))
        self.drafters = Drafters(config, model.config.get_text_config().vocab_size, prompt,
                                 request.shared_drafter, self._model_drafter())
        self.window = JacobiWindow(config.window_levels, config.window_columns, config.seed or 0) \
            if config.window_size else None
        if self.window is not None:
            self.window.reset(prompt)
        self.planner = StepPlanner(request.cost_curve, len(SOURCE_DRAFTER), config.window_size)
        self.device = request.input_ids.device

    def _model_drafter(self) -> ModelDrafter | None:
        """The draft model's drafter (None without a draft model); it skips the prompt's left padding."""
        if self.request.draft_model is None:
            return None
        skip = int(self.prefix_hidden.long().cumprod(0).sum()) if self.prefix_hidden is not None else 0
        processor = self.request.logits_processor if self._has_processors() else None
        return ModelDrafter(self.request.draft_model, self.config.draft_tokens, self.rule.propose, processor, skip)

    @torch.no_grad()
    def run(self) -> torch.Tensor:
        """Generate until a stopping criterion fires; returns [1, L + new] token ids (on the input's device)."""
        start = time.perf_counter()
        finished = self._prefill()
        while not finished:
            finished = self._step()
        self.stats.total_time = time.perf_counter() - start
        if self.request.streamer is not None:
            self.request.streamer.end()
        return torch.from_numpy(self.ids[: self.length].copy()).to(self.device).view(1, -1)

    def _prefill(self) -> bool:
        """Forward the prompt and commit its next token (by the rule); returns whether generation is done."""
        t0 = time.perf_counter()
        inputs = self.model.prepare_inputs_for_generation(self.request.input_ids, is_first_iteration=True,
                                                          **self.request.prompt_kwargs)
        logits = self.model(**inputs, return_dict=True).logits[0, -1]  # [V]
        self.prefix_len = self.cache.get_seq_length()
        positions = inputs.get("position_ids")
        self.root_position = int(positions[0, -1]) + 1 if positions is not None else self.prefix_len
        scores = self._scorer([], logits) if self._has_processors() else logits
        token = self.rule.first(scores, self.length)
        tokens, finished = self._cut_at_stop([token])
        self.stats.prefill_time = time.perf_counter() - t0
        self.stats.new_tokens += len(tokens)
        self._publish(tokens)
        return finished

    def _step(self) -> bool:
        """One speculative step; returns whether generation is done."""
        t0 = time.perf_counter()
        root = int(self.ids[self.length - 1])
        candidates = self.drafters.draft(root, max_len=self.request.max_length - self.length - 1)
        tree, use_window = self.planner.plan(candidates)
        window = self.window if use_window else None
        inputs = pack(tree, window, self.root_position, self.prefix_len, self.prefix_hidden,
                      self.model.dtype, self.device)
        t1 = time.perf_counter()
        logits = self.model(input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                            attention_mask=inputs.attention_mask, past_key_values=self.cache,
                            use_cache=True, return_dict=True).logits[0]  # [T, V]
        t2 = time.perf_counter()
        verdict = self.rule.walk(tree, logits[: inputs.n_tree], self._node_scorer(), root_index=self.length - 1,
                                 sampled=self.drafters.sampled_drafts(tree))
        tokens, finished = self._cut_at_stop(verdict.tokens)
        keep_rows(self.cache, self.prefix_len, verdict.path[: len(tokens)])
        self.planner.learn(candidates, tokens, window is not None, POOL)
        self._advance(tokens, logits[inputs.n_tree:] if window is not None else None)
        self._record(tree, verdict, tokens, inputs.input_ids.shape[1])
        self.stats.draft_time += t1 - t0
        self.stats.forward_time += t2 - t1
        self.stats.verify_time += time.perf_counter() - t2
        return finished

    def _advance(self, tokens: list[int], window_logits: torch.Tensor | None) -> None:
        """Move the root past `tokens`, iterate the window (if it ran), feed the drafters, stream the tokens."""
        self.prefix_len += len(tokens)
        self.root_position += len(tokens)
        if self.prefix_hidden is not None:
            self.prefix_hidden = torch.cat([self.prefix_hidden, torch.zeros(len(tokens), dtype=torch.bool)])
        if window_logits is not None:
            outputs = window_logits.argmax(dim=-1).cpu().numpy()
            grams = self.window.advance(outputs, len(tokens), self.ids[: self.length])
            self.drafters.harvest(grams)
        self._publish(tokens)

    def _publish(self, tokens: list[int]) -> None:
        """Tell the drafters and the streamer about committed tokens (already written to `self.ids`)."""
        self.drafters.observe(self.ids[: self.length])
        if self.request.streamer is not None:
            self.request.streamer.put(torch.tensor(tokens, dtype=torch.long))

    def _cut_at_stop(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Commit `tokens` one by one, stopping right after the first that ends generation (as plain greedy)."""
        for i, token in enumerate(tokens):
            self.ids[self.length] = token
            self.length += 1
            if self.length >= self.request.max_length or self._criteria_fire():
                return tokens[: i + 1], True
        return tokens, False

    def _criteria_fire(self) -> bool:
        """Whether HF's stopping criteria fire on the committed text."""
        ids = torch.from_numpy(self.ids[: self.length]).to(self.device).view(1, -1)
        return bool(self.request.stopping_criteria(ids, None).any())

    def _has_processors(self) -> bool:
        """Whether the generation config adds logits processors or warpers."""
        return len(self.request.logits_processor) > 0

    def _node_scorer(self):
        """The per-node scorer for the rule's walk (None when raw logits are final)."""
        if self._has_processors():
            return self._scorer
        return None if not self.request.do_sample else (lambda path, row: row.float())

    def _scorer(self, path: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Processed scores [V] of a node whose context is the committed text plus `path`."""
        ids = np.concatenate([self.ids[: self.length], np.asarray(path, dtype=np.int64)])
        ids = torch.from_numpy(ids).to(self.device).view(1, -1)
        return self.request.logits_processor(ids, logits.float().clone().view(1, -1))[0]

    def _record(self, tree: DraftTree, verdict: Verdict, tokens: list[int], n_rows: int) -> None:
        """Add this step to the stats (accepted drafts attributed to the drafter that proposed them)."""
        accepted = verdict.path[1: len(tokens)]
        self.stats.record_step(len(tokens), n_rows, [SOURCE_DRAFTER[tree.source[n]] for n in accepted])


def _hidden_slots(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[L] bool of padded prompt slots from a 2D attention mask (None when nothing is padded)."""
    if attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask.all()):
        return None
    return ~attention_mask[0].bool().cpu()
