"""benchmarks/bench_copy_oracle.py: the context-copy upper bound on tokens per step."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_copy_oracle as oracle  # noqa: E402  (the benchmarks folder is not a package)
from prompts import Prompt  # noqa: E402
from tiny_models import word_tokenizer  # noqa: E402


def test_the_best_copy_is_the_longest_continuation_of_any_earlier_occurrence():
    text = np.array([5, 1, 2, 9, 5, 1, 2, 3, 4, 7, 5, 1, 2, 3, 4, 8])
    # At the last 5 (index 10): after index 0 come 1 2 9 (2 right), after index 4 come 1 2 3 4 7 (4 right).
    assert oracle.best_copy(text, 10, min_match=1, max_copy=8) == 4
    assert oracle.best_copy(text, 10, min_match=1, max_copy=3) == 3
    # Matching the last two tokens (4 5 at 9-10 never occurred before): no occurrence qualifies.
    assert oracle.best_copy(text, 10, min_match=2, max_copy=8) == 0
    # At 2 (index 12) with its suffix 1 2: index 6's continuation 3 4 7 gets two right, index 2's 9 none.
    assert oracle.best_copy(text, 12, min_match=2, max_copy=8) == 2


def test_the_oracle_copies_only_text_known_at_the_step():
    text = np.array([1, 2, 1, 2, 1, 2, 1, 2])
    # Known: 1 2 1 (up to index 2). The occurrence at 0 continues 2 1 ... but only index 1..2 are known: 2 copied.
    assert oracle.best_copy(text, 2, min_match=1, max_copy=8) == 2
    assert oracle.oracle_steps(text, 2, min_match=1, max_copy=8) == 2  # +3 (2 copied + 1), then +2 (1 + 1)
    assert oracle.oracle_steps(text, 2, min_match=1, max_copy=1) == 3  # 2 tokens per step at most
    assert oracle.oracle_steps(np.array([1, 2, 3, 4]), 0, min_match=1, max_copy=8) == 3  # nothing to copy


def _run(method: str, prompt_id: str, tokens: list[int], **fields) -> dict:
    return {"method": method, "prompt_id": prompt_id, "repeat": 0, "tokens": tokens, **fields}


def test_measure_compares_the_oracle_with_the_measured_steps_and_bounds_the_speed():
    tokenizer = word_tokenizer()
    prompt = Prompt(id="t/0", category="code", text="w5 w6 w7 w8 w9", chat=False)
    generated = [5, 6, 7, 8, 9, 11]  # the prompt copied, then one new token
    result = {"prompts": [{"id": "t/0", "category": "code", "prompt_tokens": 5}],
              "runs": [_run("hf_greedy", "t/0", generated, seconds=7.0),
                       _run("lookahead", "t/0", generated, new_tokens=6, tokens_per_step=2.5,
                            first_token_seconds=1.0),
                       _run("lookahead_off", "t/0", generated, new_tokens=6, seconds=6.0, first_token_seconds=1.0)]}
    rows = oracle.measure(result, {"t/0": prompt}, tokenizer, min_match=1, max_copy=8)
    # Root 5 (the prefill's token): the prompt's 5 6 7 8 9 predicts 6 7 8 9 (4 copied) + 1 = 5 tokens, then 11.
    assert rows["code"]["steps"] == 1 and rows["code"]["tokens"] == 5
    assert rows["code"]["oracle_tokens_per_step"] == pytest.approx(5.0)
    assert rows["code"]["lookahead_tokens_per_step"] == pytest.approx(2.5)
    # One-row step = (6 - 1) / 5 = 1 s; the oracle needs 5 tokens / 5 per step = 1 step: 1 s prefill + 1 s.
    assert rows["code"]["ceiling"] == pytest.approx(7.0 / 2.0)
    assert rows["all"]["oracle_tokens_per_step"] == rows["code"]["oracle_tokens_per_step"]
    table = oracle.format_table(rows, 1, 8)
    assert "| code | 5.00 | 2.50 | 3.50x |" in table


def test_a_prompt_that_no_longer_encodes_as_in_the_run_is_refused():
    prompt = Prompt(id="t/0", category="code", text="w5 w6", chat=False)
    result = {"prompts": [{"id": "t/0", "category": "code", "prompt_tokens": 9}],
              "runs": [_run("hf_greedy", "t/0", [1, 2])]}
    with pytest.raises(ValueError, match="t/0 encodes to 2 tokens, the run had 9"):
        oracle.measure(result, {"t/0": prompt}, word_tokenizer(), 1, 8)
