"""`DecodeRequest`: what one decoding run needs from `generate`, as transformers prepared it (the record that
`hf.py` builds and `decoder.py` and `sequence.py` read)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .cost_curve import CostCurve
from .draft_head import DraftHead
from .drafters import SharedDrafter
from .recycle import RecycleTable
from .recycle_prior import RecyclePrior
from .thread_governor import ThreadGovernor


@dataclass
class DecodeRequest:
    """What one decoding run needs from `generate` (all prepared by transformers).

    input_ids: [B, L] prompts (left-padded when B > 1); prompt_kwargs: the model kwargs for the prefill forward
    (cache, attention mask, position ids, ...); logits_processor / stopping_criteria: HF lists; max_length:
    prompt + new tokens cap; streamer: optional HF streamer that receives committed tokens (B = 1 only);
    shared_drafter: optional cross-request drafter (see `drafters.SharedDrafter`); cost_curve: the model's
    measured cost curve (None = verify the whole tree and window every step); batch_cost_curve: the curve
    measured at the request's batch size (batches only; used while more than one sequence runs); do_sample:
    sample instead of greedy; draft_model: optional small causal LM with the target's vocabulary (checked by
    the caller) that drafts a chain each step; pad_finished: a sequence stops at its stopping criteria and is
    padded with `pad_token_id` (HF does this when an EOS criterion exists; otherwise a stopped sequence keeps
    generating until every sequence has stopped); recycle_table: the token-recycling table the generation reads
    and refreshes (shared across calls; None = a private one); record_scores: keep every generated token's
    raw logits and processed scores for `Decoder.step_outputs`; copies: `num_return_sequences` (transformers
    has already repeated each prompt into that many adjacent sequences of `input_ids` and `prompt_kwargs`);
    follow_timings: correct the curve by the generation's own timed steps (False: plan on the curves alone);
    draft_head: a learned head that drafts the token after the root from the target's hidden state (None: none);
    recycle_prior: rows seeded into the recycling table's empty rows (`recycle_prior.py`; None: none);
    uncached: how many of each prompt's last tokens the prefill forwards when the prompt restarts from a cache the
    caller passed and repeats its tokens (None: the whole prompt), as transformers' own prefill slices it;
    threads: the model's `ThreadGovernor`, which moves the steps to fewer threads while other processes hold the cores
    (None: the caller's thread count throughout, numba's following torch's).
    """

    input_ids: torch.Tensor
    prompt_kwargs: dict
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    max_length: int
    streamer: BaseStreamer | None = None
    shared_drafter: SharedDrafter | None = None
    cost_curve: CostCurve | None = None
    batch_cost_curve: CostCurve | None = None
    do_sample: bool = False
    draft_model: PreTrainedModel | None = None
    pad_finished: bool = True
    pad_token_id: int | None = None
    recycle_table: RecycleTable | None = None
    record_scores: bool = False
    copies: int = 1
    follow_timings: bool = True
    draft_head: DraftHead | None = None
    recycle_prior: RecyclePrior | None = None
    uncached: int | None = None
    threads: ThreadGovernor | None = None
