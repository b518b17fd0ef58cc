"""Prefill and the step loop over a batch of `Sequence`s: draft → plan → pack → forward → verify → commit →
compact the cache → update; finished sequences leave the batch."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace

import torch

from .attention import prompt_after_cache
from .budget import BatchPlanner
from .cache import keep_rows_batched, keep_sequences
from .compat import CACHE_KWARG
from .config import LookaheadConfig
from .hidden_tap import hidden_tap
from .layout import pack_batch, sliding_window
from .prefill import prefill_by_prompt
from .request import DecodeRequest
from .rest import DraftRest
from .rules import draws_follow_the_plan
from .scores import padded_tail_logits, step_outputs
from .sequence import Sequence
from .stats import DecodeStats
from .thread_governor import ThreadGovernor
from .tree import DraftTree
from .verify import Verdict


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's part of a step: its planned tree and whether its window runs; once verified, the rule's
    verdict on the tree and the tokens committed (a prefix of `verdict.tokens`)."""

    sequence: Sequence
    tree: DraftTree
    use_window: bool
    verdict: Verdict | None = None
    committed: list[int] | None = None

    @property
    def kept_nodes(self) -> list[int]:
        """The tree nodes whose cache slots stay: the path of the committed tokens, root first."""
        return self.verdict.path[: len(self.committed)]


class Decoder:
    """Runs one lookahead generation for one request; `run()` returns the sequences [B, L + new]."""

    def __init__(self, model, config: LookaheadConfig, request: DecodeRequest):
        self.model, self.config, self.request = model, config, request
        self.cache = request.prompt_kwargs[CACHE_KWARG]  # checked compactable at the boundary (hf.py)
        self.device = request.input_ids.device
        self.stats = DecodeStats()
        self.sequences: list[Sequence] = []
        self.active: list[int] = []  # indices into `sequences`, in the cache's batch order
        self.cut_at_stop = request.pad_finished or request.input_ids.shape[0] == 1
        self.batch_planner = BatchPlanner(request.cost_curve, request.batch_cost_curve, request.input_ids.shape[0],
                                          draws_follow_the_plan(request.do_sample, config.seed,
                                                                request.draft_model is not None),
                                          request.follow_timings)
        self.window = sliding_window(model.config)  # the step masks apply it (the cache keeps every slot)
        self.tap = None  # the hidden-state tap while `run()` runs with a draft head
        self.rest = DraftRest(config.rest_drafters and request.input_ids.shape[0] == 1
                              and request.cost_curve is not None and self.batch_planner.timed)
        self.threads = request.threads or ThreadGovernor()

    @torch.no_grad()
    def run(self) -> torch.Tensor:
        """Generate until every sequence is done; returns [B, L + new] token ids (on the input's device)."""
        start = time.perf_counter()
        try:
            with hidden_tap(self.model, self.request.draft_head is not None) as tap:
                self.tap = tap
                self._prefill()
                while self.active:
                    self._step()
        finally:  # an interrupted run's stats (a streamer that raised, Ctrl-C) hold its time so far
            self.stats.total_time = time.perf_counter() - start
        if self.request.streamer is not None:
            self.request.streamer.end()
        return self._output()

    def governed_threads(self):
        """A context within which the generation's thread count is governed (`ThreadGovernor.running`, a batch's
        steps judged by its batch's cost curve; without a governor the caller's count, numba's following torch's);
        wrap `run` (and the set-up before it) in it."""
        request = self.request
        curve = request.batch_cost_curve if request.input_ids.shape[0] > 1 else request.cost_curve
        return self.threads.running(curve, request.threads is not None)

    def step_outputs(self, sequences: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(scores, logits) of every generated position of `sequences` (what `run()` returned), one [B, V] tensor
        per position as `generate` returns them; needs `request.record_scores`."""
        prompt_len = self.request.input_ids.shape[1]
        tail = functools.partial(padded_tail_logits, self.model, sequences,
                                 self.request.prompt_kwargs.get("attention_mask"), prompt_len)
        return step_outputs([s.record for s in self.sequences], sequences, prompt_len, tail,
                            lambda b, text, logits: self.sequences[b].process(text.cpu().numpy(), logits))

    def _prefill(self) -> None:
        """Forward the prompts (each distinct prompt once, its copies share the cache entries) and commit each
        sequence's next token."""
        t0 = time.perf_counter()
        request, copies = self.request, self.request.copies
        kwargs = _one_copy_each(request.prompt_kwargs, copies)
        if getattr(self.model, "_supports_logits_to_keep", lambda: False)():
            kwargs.setdefault("logits_to_keep", 1)  # the LM head only for the last position
        inputs = self.model.prepare_inputs_for_generation(request.input_ids[::copies], is_first_iteration=True,
                                                          next_sequence_length=request.uncached, **kwargs)
        logits = prefill_by_prompt(self.model, inputs, self.cache)  # [B / copies, V] or None: batched
        if logits is None:
            with prompt_after_cache():  # the prompt's rest after a reused cache runs as a prefill too
                logits = self.model(**inputs, return_dict=True).logits[:, -1]
        prompts = request.input_ids.cpu().numpy()
        if copies > 1:
            keep_sequences(self.cache, [b // copies for b in range(len(prompts))])
        self.prefix_len = self.cache.get_seq_length()
        hidden = self._prefill_hidden(len(prompts) // copies)
        positions, mask = inputs.get("position_ids"), request.prompt_kwargs.get("attention_mask")
        vocab = self.model.config.get_text_config().vocab_size
        for b, prompt in enumerate(prompts):
            first = b // copies  # this prompt's batch index in the prefill
            root_position = int(positions[first, -1]) + 1 if positions is not None else self.prefix_len
            sequence = Sequence(b, prompt, _hidden_slots(mask, b), root_position, self.config, request, vocab,
                                use_window=len(prompts) == 1)
            tokens = sequence.commit([sequence.first_token(logits[first])], request.max_length, self.cut_at_stop)
            sequence.drafters.observe(sequence.ids[: sequence.length])
            sequence.drafters.observe_hidden(None if hidden is None else hidden[first])
            self.sequences.append(sequence)
            self.stats.new_tokens += 1
            self.stats.prefill_time = time.perf_counter() - t0
            self._stream(tokens)  # counted first: a streamer that raises leaves stats of what it was sent
        self.active = list(range(len(prompts)))
        self._retire()

    def _step(self) -> None:
        """One speculative step of every active sequence in ONE forward."""
        t0 = time.perf_counter()
        drafted = not self.rest.rests()
        sequences = [self.sequences[i] for i in self.active]
        steps = self._plan(sequences) if drafted else [SequenceStep(s, s.plain_tree(), False) for s in sequences]
        inputs = pack_batch([s.sequence.drafts(s.tree, s.use_window) for s in steps], self.prefix_len,
                            self.model.dtype, self.device, self.window)
        reduced, probe = self.threads.reduced_now, self.threads.probing
        t1 = time.perf_counter()
        logits = self.model(input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                            attention_mask=inputs.attention_mask, **{CACHE_KWARG: self.cache},
                            use_cache=True, return_dict=True).logits  # [B, T, V]
        t2 = time.perf_counter()
        hidden = self.tap.last() if self.tap is not None else None  # [B, T, size]: the LM head's input
        limit = self._limit()
        steps = [self._verify(step, logits[b, : inputs.n_tree[b]], limit) for b, step in enumerate(steps)]
        slots = keep_rows_batched(self.cache, self.prefix_len, [s.kept_nodes for s in steps])
        self.stats.draft_time += t1 - t0
        self.stats.forward_time += t2 - t1
        for b, step in enumerate(steps):
            window_logits = logits[b, inputs.n_tree[b]:] if step.use_window else None
            if hidden is not None:  # the row that chose the next root
                step.sequence.drafters.observe_hidden(hidden[b, step.kept_nodes[-1]].clone())
            step.sequence.advance(step.committed, step.use_window, window_logits, self.prefix_len, slots)
            self.stats.record_step(len(step.committed), inputs.input_ids.shape[1],
                                   step.sequence.accepted_sources(step.tree, step.verdict, len(step.committed)))
            self._stream(step.committed)
        self.prefix_len += slots
        self._retire()
        if not probe:  # a probe's one step on all threads says nothing of the steps around it
            self.batch_planner.record(inputs.input_ids.shape[1], t2 - t1)
        if self.threads.record(inputs.input_ids.shape[1], t2 - t1):
            self.batch_planner.forget_timings()
        self.stats.fewer_threads_steps += len(steps) if reduced else 0  # counted per sequence, as `steps` is
        end = time.perf_counter()
        self.stats.verify_time += end - t2
        self.rest.record(drafted, len(steps[0].committed), end - t0, t2 - t1, self.batch_planner.observed.plain_seconds)

    def _prefill_hidden(self, prompts: int) -> torch.Tensor | None:
        """[prompts, size] the hidden state of each prompt's last position as the prefill's LM head received it (one
        batched forward or one per prompt), or None when not tapped or not one row per prompt."""
        if self.tap is None:
            return None
        seen = self.tap.take()
        rows = torch.cat([h[:, -1] for h in seen]) if seen else None
        return rows if rows is not None and rows.shape[0] == prompts else None

    def _verify(self, step: SequenceStep, logits: torch.Tensor, limit: int) -> SequenceStep:
        """`step` with the rule's verdict on its tree rows' raw logits [N, V] and the tokens it commits (the text
        never grows past length `limit`)."""
        verdict = step.sequence.verify(step.tree, logits)
        return replace(step, verdict=verdict, committed=step.sequence.commit(verdict.tokens, limit, self.cut_at_stop))

    def _plan(self, sequences: list[Sequence]) -> list[SequenceStep]:
        """Each sequence's step as the batch planner plans it from the sequence's candidates
        (`budget.BatchPlanner.plan`)."""
        plans = self.batch_planner.plan([s.planner for s in sequences], [s.candidates() for s in sequences],
                                        self.prefix_len)
        return [SequenceStep(s, tree, use_window) for s, (tree, use_window) in zip(sequences, plans)]

    def _limit(self) -> int:
        """The length no sequence may pass: `max_length`, or once every sequence has stopped, the longest
        stop length (the length plain decoding ends at)."""
        stops = [s.stop_length for s in self.sequences]
        return max(stops) if all(stops) else self.request.max_length

    def _retire(self) -> None:
        """Drop finished sequences from the batch and the cache."""
        limit = self._limit()
        keep = [pos for pos, i in enumerate(self.active) if not self._finished(self.sequences[i], limit)]
        if len(keep) < len(self.active):
            if keep:
                keep_sequences(self.cache, keep)
            self.active = [self.active[pos] for pos in keep]

    def _finished(self, sequence: Sequence, limit: int) -> bool:
        """Whether `sequence` needs no more tokens."""
        return sequence.length >= limit or (self.cut_at_stop and sequence.stop_length is not None)

    def _stream(self, tokens: list[int]) -> None:
        """Send committed tokens to the streamer (single-sequence generations only)."""
        if self.request.streamer is not None:
            self.request.streamer.put(torch.tensor(tokens, dtype=torch.long))

    def _output(self) -> torch.Tensor:
        """[B, length] sequences: each sequence's committed text, padded with the pad token after its stop."""
        length = self._limit()
        pad = self.request.pad_token_id if self.request.pad_token_id is not None else 0
        out = torch.full((len(self.sequences), length), pad, dtype=torch.long)
        for b, sequence in enumerate(self.sequences):
            n = min(sequence.length, length)
            out[b, :n] = torch.from_numpy(sequence.ids[:n])
        return out.to(self.device)


def _one_copy_each(kwargs: dict, copies: int) -> dict:
    """`kwargs` with transformers' `num_return_sequences` expansion undone: each tensor keeps the first of every
    `copies` adjacent batch entries (multimodal position ids [3, B, L] along their batch dim 1, as it expands them)."""
    if copies == 1:
        return dict(kwargs)
    out = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            value = value[:, ::copies] if name == "position_ids" and value.dim() == 3 else value[::copies]
        out[name] = value
    return out


def _hidden_slots(attention_mask: torch.Tensor | None, b: int) -> torch.Tensor | None:
    """[L] bool of the padded prompt slots of sequence `b` of the batch from a 2D attention mask (None if none)."""
    if attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask[b].all()):
        return None
    return ~attention_mask[b].bool().cpu()
