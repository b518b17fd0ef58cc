"""Which logits-processor lists score each row from that row alone.

Transformers' processors take a batch: `input_ids` [B, n] and `scores` [B, V]. Some keep per-batch state (the
repetition penalty's per-sequence prompt lengths, watermarks, constrained prefixes), so a verification walk that
scores one node of one sequence hands them the whole batch: B rows for one row's answer, a cost that grows as
B² per step under sampling. The warpers listed here compute every output row from the same row of `scores`
alone (elementwise maps, and sorts, softmaxes and top-k within the row) and ignore `input_ids`: for a list made
only of them, a single row gives that row's result.
"""

from __future__ import annotations

import torch
from transformers import (EpsilonLogitsWarper, EtaLogitsWarper, LogitsProcessorList, MinPLogitsWarper,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper)

from .top_p import SortedTopP

# Exact types: a subclass may add state or read `input_ids`.
ROW_WARPERS = (TemperatureLogitsWarper, TopPLogitsWarper, SortedTopP, TopKLogitsWarper, MinPLogitsWarper,
               TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper)


def scores_rows_alone(processors: LogitsProcessorList) -> bool:
    """Whether every processor of `processors` is one of `ROW_WARPERS` (by exact type), so the list can run
    on one row of a batch (True for an empty list)."""
    return all(type(processor) in ROW_WARPERS for processor in processors)


def run_row_warpers(processors: LogitsProcessorList, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """`processors(input_ids, scores)` for a list `scores_rows_alone` accepts: each warper called in turn, as the
    list itself calls a processor that takes no extra arguments, without its per-call signature inspection."""
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores
