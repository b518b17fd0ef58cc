"""`return_dict_in_generate=True` with `output_scores` / `output_logits`: lookahead returns the tensors plain
`generate` returns (fp32 tolerance), greedy and sampling, batch 1 and left-padded batches (sequences
finishing at EOS included), while its drafts really get accepted.

For sampling the reference is plain `generate` made to draw lookahead's tokens (its `torch.multinomial` replaced
by a stub that returns them), so HF's own loop records the scores and logits of the same text.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_batch import padded_batch
from tiny_models import build_tiny_model, repetitive_prompt

from lookahead import Lookahead, LookaheadConfig
from lookahead.scores import ScoreRecord, step_outputs
from lookahead.verify import Verdict

OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
SAMPLING = dict(do_sample=True, temperature=0.8, top_p=0.9)
SPECULATE = dict(adaptive=False, tree_budget=12)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("llama", dtype=torch.float32, seed=1)


def assert_same_outputs(plain, ours) -> None:
    """Same sequences; scores and logits equal to fp32 tolerance, step by step ([B, V] each; -inf where masked)."""
    assert torch.equal(plain.sequences, ours.sequences)
    for name in ("scores", "logits"):
        expected, got = getattr(plain, name), getattr(ours, name)
        assert len(expected) == len(got) > 0, name
        for step, (e, g) in enumerate(zip(expected, got)):
            assert g.dtype == e.dtype and g.shape == e.shape, f"{name}[{step}]"
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}[{step}]: {m}")


def assert_speculated(decoder: Lookahead) -> None:
    """Some step committed more than one token (otherwise only the prefill/plain path would be tested)."""
    assert max(decoder.last_stats.tokens_per_step) > 1, "drafts must be accepted for this test to mean anything"


@contextlib.contextmanager
def forced_draws(tokens: torch.Tensor):
    """Within the block `torch.multinomial` returns, at its k-th call, `tokens[:, k]` ([B, steps]): plain
    sampling `generate` then draws exactly these tokens and records their scores."""
    original, calls = torch.multinomial, iter(tokens.unbind(1))

    def draw(probs, num_samples, *args, **kwargs):
        return next(calls).view(-1, 1).to(probs.device)

    torch.multinomial = draw
    try:
        yield
    finally:
        torch.multinomial = original


def plain_with_tokens(model, prompt, sequences, **kwargs):
    """Plain sampling `generate` forced to draw the new tokens of `sequences`."""
    with forced_draws(sequences[:, prompt.shape[1]:]):
        return model.generate(prompt, **kwargs)


def reference(model, prompt, sequences, **kwargs):
    """Plain `generate` for the same call; when sampling, forced to draw the new tokens of `sequences`."""
    if kwargs["do_sample"]:
        return plain_with_tokens(model, prompt, sequences, **kwargs)
    return model.generate(prompt, **kwargs)


@pytest.mark.parametrize("processors", [{}, dict(repetition_penalty=1.3, no_repeat_ngram_size=4)],
                         ids=["raw", "processors"])
def test_greedy_scores_and_logits_equal_plain_generate(model, processors):
    prompt = repetitive_prompt(0)
    kwargs = dict(max_new_tokens=30, do_sample=False, **OUTPUTS, **processors)
    decoder = Lookahead(**SPECULATE)
    ours = model.generate(prompt, custom_generate=decoder, **kwargs)
    assert_same_outputs(model.generate(prompt, **kwargs), ours)
    assert_speculated(decoder)


@pytest.mark.parametrize("seed", [0, 5])
def test_seeded_sampling_scores_and_logits_equal_plain_generate(model, seed):
    prompt = repetitive_prompt(1)
    kwargs = dict(max_new_tokens=30, **SAMPLING, **OUTPUTS)
    decoder = Lookahead(seed=seed, **SPECULATE)
    ours = model.generate(prompt, custom_generate=decoder, **kwargs)
    assert_speculated(decoder)
    off = model.generate(prompt, custom_generate=Lookahead(LookaheadConfig.off(), seed=seed), **kwargs)
    assert_same_outputs(off, ours)
    assert_same_outputs(plain_with_tokens(model, prompt, ours.sequences, **kwargs), ours)


def test_unseeded_sampling_scores_equal_plain_generate(model):
    prompt = repetitive_prompt(2)
    kwargs = dict(max_new_tokens=30, **SAMPLING, top_k=8, **OUTPUTS)
    decoder = Lookahead(**SPECULATE)
    torch.manual_seed(3)
    ours = model.generate(prompt, custom_generate=decoder, **kwargs)
    assert_speculated(decoder)
    assert_same_outputs(plain_with_tokens(model, prompt, ours.sequences, **kwargs), ours)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_scores_with_a_draft_model_equal_plain_generate(model, do_sample):
    """A draft model's chain is accepted with min(1, p/q) when sampling: its nodes' scores are recorded too."""
    prompt = repetitive_prompt(3)
    kwargs = dict(max_new_tokens=24, **OUTPUTS, **(SAMPLING if do_sample else dict(do_sample=False)))
    decoder = Lookahead(draft_model=model, **SPECULATE)  # the target drafting for itself: long accepted chains
    torch.manual_seed(4)
    ours = model.generate(prompt, custom_generate=decoder, **kwargs)
    plain = reference(model, prompt, ours.sequences, **kwargs)
    assert_same_outputs(plain, ours)
    assert decoder.last_stats.accepted_by_drafter["draft_model"] > 0


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "seeded"])
def test_padded_batch_scores_and_logits_equal_plain_generate(model, do_sample):
    ids, mask = padded_batch(lengths=(24, 16, 20))
    kwargs = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=24, **OUTPUTS,
                  **(SAMPLING if do_sample else dict(do_sample=False, repetition_penalty=1.2)))
    decoder = Lookahead(seed=7, **SPECULATE)
    ours = model.generate(ids, custom_generate=decoder, **kwargs)
    plain = reference(model, ids, ours.sequences, **kwargs)
    assert_same_outputs(plain, ours)
    assert_speculated(decoder)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "seeded"])
def test_sequences_finished_at_eos_get_the_logits_plain_generate_records(model, do_sample):
    """A sequence that stops early is fed pad tokens by plain `generate`, which records its logits at every later
    step too; lookahead recomputes them."""
    ids, mask = padded_batch(lengths=(24, 16, 20))
    kwargs = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=24, **OUTPUTS,
                  **(SAMPLING if do_sample else dict(do_sample=False)))
    decoder = Lookahead(seed=7, **SPECULATE)
    free = model.generate(ids, custom_generate=decoder, **kwargs).sequences
    eos = int(free[1, ids.shape[1] + 5])  # sequence 1 stops at its 6th token at the latest
    decoder = Lookahead(seed=7, **SPECULATE)
    ours = model.generate(ids, custom_generate=decoder, eos_token_id=eos, **kwargs)
    plain = reference(model, ids, ours.sequences, eos_token_id=eos, **kwargs)
    assert_same_outputs(plain, ours)
    new = ours.sequences[:, ids.shape[1]:]
    assert int((new[1] == eos).nonzero()[0]) < new.shape[1] - 2, "sequence 1 must be padded while another goes on"
    assert_speculated(decoder)


def test_scores_only_or_logits_only(model):
    prompt = repetitive_prompt(0)
    scores = model.generate(prompt, max_new_tokens=8, return_dict_in_generate=True, output_scores=True,
                            custom_generate=Lookahead())
    logits = model.generate(prompt, max_new_tokens=8, return_dict_in_generate=True, output_logits=True,
                            custom_generate=Lookahead())
    assert scores.logits is None and len(scores.scores) == 8
    assert logits.scores is None and len(logits.logits) == 8


def test_score_record_keeps_the_walked_scores_of_the_accepted_path():
    logits = torch.arange(12, dtype=torch.float64).view(4, 3)  # [N=4 nodes, V=3]
    record = ScoreRecord()
    record.record(0, torch.zeros(1, 3), [torch.ones(3)])  # the prefill's token
    scorer = record.remembering(lambda path, row: row * 10 + len(path))
    for path, node in (([], 0), ([2], 1), ([2, 0], 3), ([1], 2)):  # [1] is walked but not on the path
        scorer(path, logits[node])
    record.record_walk(1, Verdict(tokens=[2, 0, 1], path=[0, 1, 3]), logits)
    assert [s.tolist() for s in record.scores] == [[1.0] * 3, [0.0, 10.0, 20.0], [31.0, 41.0, 51.0],
                                                   [92.0, 102.0, 112.0]]
    assert torch.equal(torch.stack(record.logits[1:]), logits[[0, 1, 3]].float())
    record.remembering(None)
    record.record_walk(2, Verdict(tokens=[1], path=[0]), logits)  # re-scores token 2 on: overwrites
    assert len(record.scores) == 3 and torch.equal(record.scores[2], logits[0].float())


def test_step_outputs_fills_a_short_sequence_from_the_tail():
    records = [ScoreRecord(), ScoreRecord()]
    records[0].record(0, torch.zeros(3, 2), [torch.zeros(2)] * 3)
    records[1].record(0, torch.ones(1, 2), [torch.ones(2)])
    sequences = torch.tensor([[5, 1, 2, 3], [5, 4, 0, 0]])  # prompt length 1, 3 steps
    tails = []

    def tail(short, steps):
        tails.append((short, steps))
        return torch.full((len(short), steps, 2), 7.0)

    scores, logits = step_outputs(records, sequences, 1, tail, lambda b, text, row: row + len(text))
    assert tails == [([1], 3)]
    assert [s[1].tolist() for s in scores] == [[1.0, 1.0], [9.0, 9.0], [10.0, 10.0]]
    assert [lg[1].tolist() for lg in logits] == [[1.0, 1.0], [7.0, 7.0], [7.0, 7.0]]
    assert all(s.shape == (2, 2) for s in scores + logits)
