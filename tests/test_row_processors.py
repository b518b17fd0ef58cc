"""Row-alone processing (`lookahead/row_processors.py`): the listed warpers give each row of a batch the result
they give that row alone, bit for bit; lists with anything else keep the batch; a sampled batch `generate`
scores each node on one row and gives the same tokens and scores as with the whole batch."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model
from transformers import (EpsilonLogitsWarper, EtaLogitsWarper, LogitsProcessorList, MinPLogitsWarper,
                          RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper, TypicalLogitsWarper)

from lookahead import Lookahead, LookaheadConfig, sequence
from lookahead.cost_curve import CostCurve
from lookahead.row_processors import ROW_WARPERS, run_row_warpers, scores_rows_alone
from lookahead.top_p import SortedTopP

WARPERS = {
    "temperature": TemperatureLogitsWarper(0.7), "top_p": TopPLogitsWarper(0.9), "sorted_top_p": SortedTopP(0.9),
    "top_k": TopKLogitsWarper(20), "min_p": MinPLogitsWarper(0.05), "typical": TypicalLogitsWarper(0.9),
    "epsilon": EpsilonLogitsWarper(3e-4), "eta": EtaLogitsWarper(3e-4),
}


def test_every_listed_warper_is_tested():
    assert {type(w) for w in WARPERS.values()} == set(ROW_WARPERS)


@pytest.mark.parametrize("vocab", [64, 49152])  # 49152: rows long enough for torch to split work by threads
@pytest.mark.parametrize("name", list(WARPERS))
def test_each_row_alone_gives_its_row_of_the_batch(name, vocab):
    generator = torch.Generator().manual_seed(vocab)
    scores = torch.randn(5, vocab, generator=generator) * torch.tensor([0.5, 1.0, 2.0, 4.0, 8.0]).view(-1, 1)
    ids = torch.randint(0, vocab, (5, 12), generator=generator)
    warper = WARPERS[name]
    whole = warper(ids, scores.clone())
    assert not torch.equal(whole, scores)  # the warper does something here
    for row in range(5):
        alone = warper(ids[row: row + 1], scores[row: row + 1].clone())
        assert torch.equal(alone[0], whole[row]), (name, row)


def test_row_warpers_run_in_turn_as_the_list_runs_them():
    torch.manual_seed(3)
    ids, scores = torch.randint(0, 64, (1, 6)), torch.randn(1, 64) * 4
    for names in (["temperature", "top_k", "sorted_top_p"], ["min_p", "temperature"], ["typical", "eta"]):
        warpers = LogitsProcessorList(WARPERS[name] for name in names)
        assert torch.equal(run_row_warpers(warpers, ids, scores.clone()), warpers(ids, scores.clone()))


def test_only_lists_of_listed_warpers_run_on_one_row():
    assert scores_rows_alone(LogitsProcessorList([TemperatureLogitsWarper(0.7), SortedTopP(0.9)]))
    assert scores_rows_alone(LogitsProcessorList())
    assert not scores_rows_alone(LogitsProcessorList([TemperatureLogitsWarper(0.7),
                                                      RepetitionPenaltyLogitsProcessor(1.2)]))

    class Reading(TopKLogitsWarper):  # a subclass may read input_ids or keep state
        pass

    assert not scores_rows_alone(LogitsProcessorList([Reading(5)]))


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts with repeated spans [3, 20] and their attention mask."""
    rows = [[5, 9, 12, 7, 30, 5, 9, 12, 7, 41, 5, 9, 12, 7, 30, 5, 9, 12, 7, 41],
            [0, 0, 0, 0, 20, 21, 22, 23, 20, 21, 22, 24, 20, 21, 22, 23, 20, 21, 22, 24],
            [0, 0, 0, 0, 0, 0, 0, 0, 33, 34, 35, 33, 34, 35, 33, 34, 35, 33, 34, 35]]
    ids = torch.tensor(rows)
    return ids, (ids != 0).long()


@pytest.mark.parametrize("settings", [dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, top_k=10, min_p=0.02)])
def test_sampled_batch_scores_each_node_on_one_row_with_the_same_result(monkeypatch, settings):
    model = build_tiny_model("llama", dtype=torch.float32, seed=5, vocab=64)
    ids, mask = _padded_batch()
    flat = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.01, 1.02, 1.05, 1.1, 1.2), 0.05)
    kwargs = dict(attention_mask=mask, pad_token_id=0, do_sample=True, max_new_tokens=20,
                  return_dict_in_generate=True, output_scores=True, **settings)
    rows_seen = []
    call = TemperatureLogitsWarper.__call__
    monkeypatch.setattr(TemperatureLogitsWarper, "__call__",
                        lambda self, i, s: rows_seen.append(s.shape[0]) or call(self, i, s))

    def run():  # a fixed curve: the same plans, so the same rows and bit-identical scores, run to run
        return model.generate(ids, custom_generate=Lookahead(LookaheadConfig(seed=3), cost_curve=flat), **kwargs)

    alone = run()
    assert rows_seen and set(rows_seen) == {1}
    monkeypatch.setattr(sequence, "scores_rows_alone", lambda processors: False)
    rows_seen.clear()
    batched = run()
    assert set(rows_seen) == {3}
    assert torch.equal(alone.sequences, batched.sequences)
    assert len(alone.scores) == 20 and all(torch.equal(a, b) for a, b in zip(alone.scores, batched.scores))
