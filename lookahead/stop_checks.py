"""Whether `generate`'s stopping criteria fire on one sequence's committed text, checked after every committed token.

`generate` hands a `StoppingCriteriaList` that nearly always holds just transformers' `MaxLengthCriteria` and
`EosTokenCriteria`. Called as a list they cost ~0.1 ms a token on the CPU here (a batch view of the text, `torch.full`,
`torch.isin`, an `or` per criterion), ~0.24 ms of a speculative step. `StopCheck` computes those two exactly as they
do — the text's length against `max_length`, its last token against the EOS ids — on numpy, and hands any other list
(custom criteria, stop strings, time limits, subclasses) to the list itself.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

# (the committed text [n] int64) -> whether the criteria fire on it
FireCheck = Callable[[np.ndarray], bool]


class StopCheck:
    """The stopping criteria of a generation, for one sequence of its batch."""

    def __init__(self, criteria, list_check: FireCheck):
        """criteria: `generate`'s stopping criteria; list_check: runs the whole list on this sequence's text (the
        path for lists this class does not compute itself)."""
        self.list_check = list_check
        known = all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in criteria)
        self.lengths = [c for c in criteria if type(c) is MaxLengthCriteria] if known else None
        eos = [c.eos_token_id.reshape(-1).tolist() for c in criteria if type(c) is EosTokenCriteria] if known else []
        self.eos = frozenset(int(token) for ids in eos for token in ids)

    def __call__(self, text: np.ndarray) -> bool:
        """Whether the criteria fire on `text` [n] int64 (the committed tokens, prompt included)."""
        if self.lengths is None:
            return self.list_check(text)
        if len(text) and int(text[-1]) in self.eos:
            return True
        for criterion in self.lengths:
            if len(text) >= criterion.max_length:
                return True
            if criterion.max_position_embeddings is not None and len(text) > criterion.max_position_embeddings:
                self.list_check(text)  # transformers' once-per-process warning about the model's length
        return False
