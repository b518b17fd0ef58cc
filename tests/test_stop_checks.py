"""`stop_checks.StopCheck`: transformers' max-length and EOS criteria computed on numpy exactly as the list computes
them (every length and last token of a table of texts), anything else handed to the list."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, StoppingCriteria,
                                                       StoppingCriteriaList)

from lookahead.stop_checks import StopCheck


class _Calls:
    """The list path: the criteria called as `generate` calls them, counted."""

    def __init__(self, criteria):
        self.criteria, self.count = criteria, 0

    def __call__(self, text: np.ndarray) -> bool:
        self.count += 1
        return bool(self.criteria(torch.from_numpy(text).view(1, -1), None)[0])


class _Odd(StoppingCriteria):
    """A custom criterion: stops on an odd last token."""

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] % 2 == 1


LISTS = {
    "length-and-eos": [MaxLengthCriteria(9), EosTokenCriteria(torch.tensor([3, 7]))],
    "eos-int": [EosTokenCriteria(5)],
    "length-only": [MaxLengthCriteria(6)],
    "two-lengths": [MaxLengthCriteria(12), MaxLengthCriteria(7)],
    "custom": [MaxLengthCriteria(9), _Odd()],
    "empty": [],
}


@pytest.mark.parametrize("name", list(LISTS))
def test_fires_exactly_when_the_list_does(name):
    criteria = StoppingCriteriaList(LISTS[name])
    calls = _Calls(criteria)
    check = StopCheck(criteria, calls)
    rng = np.random.default_rng(0)
    for length in range(1, 14):
        for _ in range(6):
            text = rng.integers(0, 10, length).astype(np.int64)
            assert check(text) == calls.criteria(torch.from_numpy(text).view(1, -1), None)[0].item()
    assert (calls.count > 0) == (name == "custom")  # only a list it does not know goes through the list


def test_past_the_models_positions_the_list_runs_for_its_warning():
    criteria = StoppingCriteriaList([MaxLengthCriteria(20, max_position_embeddings=4)])
    calls = _Calls(criteria)
    check = StopCheck(criteria, calls)
    assert not check(np.arange(4)) and calls.count == 0
    assert not check(np.arange(5)) and calls.count == 1
