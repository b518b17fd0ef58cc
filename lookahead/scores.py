"""Per-token scores and logits for `generate(return_dict_in_generate=True, output_scores=/output_logits=True)`.

Plain `generate` records, at every step, each sequence's raw logits (float32) and its processed scores (after the
logits processors and warpers) in tuples of `[B, V]` tensors, one per generated position. Verification already
computes both for every committed token: the raw logits are the accepted path's rows of the step's forward, and
the processed scores are what the rule's walk scored at those nodes. `ScoreRecord` keeps them per sequence;
`step_outputs` lays them out as `generate` does. A sequence of a batch that stopped early is fed pad tokens by
plain `generate`, which still records its logits at every later step: `step_outputs` recomputes those with one
forward of the finished sequences' padded text.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .verify import NodeScorer, Verdict

# (batch index of a sequence, token ids [n] of its text, raw logits [V]) -> its processed scores [V]
RowProcessor = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class ScoreRecord:
    """One sequence's raw logits and processed scores, each a float32 `[V]` per generated token (index 0 = the
    first new token). A later step that re-scores a position overwrites it; `step_outputs` reads only the
    committed ones."""

    def __init__(self):
        self.logits: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []
        self._walked: dict[tuple[int, ...], torch.Tensor] = {}

    def remembering(self, scorer: NodeScorer | None) -> NodeScorer | None:
        """`scorer` wrapped so that a walk's processed scores are kept by path for `record_walk` (None stays
        None: then the raw logits are the scores, as `generate` with no processors records them)."""
        self._walked = {}
        if scorer is None:
            return None

        def remember(path: list[int], row: torch.Tensor) -> torch.Tensor:
            scores = scorer(path, row)
            self._walked[tuple(path)] = scores
            return scores
        return remember

    def record_walk(self, start: int, verdict: Verdict, logits: torch.Tensor) -> None:
        """Record the tokens of `verdict` as new tokens `start, start + 1, ...`: token i was chosen at node
        `verdict.path[i]` (raw logits `logits[path[i]]`, `logits` [N, V]) from the scores the walk computed
        with prefix `verdict.tokens[:i]`."""
        rows = logits[torch.as_tensor(verdict.path, device=logits.device)].float()  # [n, V], a copy
        scores = [self._walked[tuple(verdict.tokens[:i])] if self._walked else rows[i]
                  for i in range(len(verdict.tokens))]
        self.record(start, rows, scores)

    def record(self, start: int, logits: torch.Tensor, scores: list[torch.Tensor]) -> None:
        """Record raw logits [n, V] and processed scores (n tensors [V]) as new tokens `start ... start+n-1`."""
        del self.logits[start:], self.scores[start:]
        self.logits.extend(logits.to(torch.float32, copy=True).unbind(0))
        self.scores.extend(s.to(torch.float32, copy=True) for s in scores)


def step_outputs(records: list[ScoreRecord], sequences: torch.Tensor, prompt_len: int,
                 tail: Callable[[list[int], int], torch.Tensor], process: RowProcessor,
                 ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(scores, logits) as `generate` returns them: one `[B, V]` tensor per generated position of `sequences`
    [B, prompt_len + steps].

    Sequence b's first `len(records[b])` tokens come from its record; a sequence with fewer (it stopped early and
    was padded) gets the rest from `tail(short, steps)`, which returns the raw logits [len(short), steps, V] of the
    sequences `short` at every generated index given their padded text, processed by `process(b, text, logits)`.
    """
    steps = sequences.shape[1] - prompt_len
    logits = [record.logits[:steps] for record in records]
    scores = [record.scores[:steps] for record in records]
    short = [b for b, rows in enumerate(logits) if len(rows) < steps]
    if short:
        extra = tail(short, steps)  # [len(short), steps, V]
        for i, b in enumerate(short):
            for k in range(len(logits[b]), steps):
                logits[b].append(extra[i, k])
                scores[b].append(process(b, sequences[b, : prompt_len + k], extra[i, k]))
    return (tuple(torch.stack([rows[k] for rows in scores]) for k in range(steps)),
            tuple(torch.stack([rows[k] for rows in logits]) for k in range(steps)))


def padded_tail_logits(model, sequences: torch.Tensor, prompt_mask: torch.Tensor | None, prompt_len: int,
                       finished: list[int], steps: int) -> torch.Tensor:
    """Raw float32 logits [len(finished), steps, V] that plain `generate` computes for the sequences `finished`
    (batch indices into `sequences` [B, prompt_len + steps]) at each generated index: one forward of their text
    (prompt, output and pad fill) with the prompt's padding mask, every later token visible and positions counted
    as `generate` counts them (`prompt_mask` [B, prompt_len] or None = no padding)."""
    ids = sequences[finished, : prompt_len + steps - 1]
    mask = torch.ones_like(ids)
    if prompt_mask is not None:
        mask[:, :prompt_len] = prompt_mask[finished]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, return_dict=True)
    return out.logits[:, prompt_len - 1:].float()
