"""The learned draft head: its inference equals the trained net, its files tie it to its model, it reads the hidden
state of the row that chose the root, and generation with it stays exact (greedy identical, seeded sampling
identical) while its drafts are accepted."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt, word_tokenizer

from lookahead import Lookahead, LookaheadConfig, head_files, streamed_gemm
from lookahead.draft_head import DraftHead
from lookahead.drafters import HEAD, HEAD_SOURCES, SOURCE_DRAFTER
from lookahead.head_training import (GROUNDED_REQUESTS, Example, HeadNet, _teacher_forced, distill, fit,
                                      head_weights)
from lookahead.hidden_tap import hidden_tap

VOCAB = 32


def _examples(model, count: int, new_tokens: int = 40) -> list[Example]:
    """Greedy continuations of random prompts (one batch), teacher-forced into head examples."""
    prompts = torch.cat([repetitive_prompt(seed, vocab=VOCAB, length=12) for seed in range(count)])
    texts = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                           max_new_tokens=new_tokens)
    return [_teacher_forced(model, text) for text in texts]


def _trained(model, epochs: int = 25):
    """(net, vocabulary, report) of a head fitted on the model's own greedy text."""
    return fit(_examples(model, 48), model.get_input_embeddings().weight, vocab_size=VOCAB, epochs=epochs, inter=64,
               lr=1e-2, held_out=0.2)


@pytest.fixture(scope="module")
def trained():
    """A tiny llama (fp32) and a head file trained for it: (model, net, vocab, report, path)."""
    model = build_tiny_model("llama", dtype=torch.float32, seed=3, vocab=VOCAB)
    net, vocab, report = _trained(model)
    path = _save(model, net, vocab)
    return model, net, vocab, report, path


def _save(model, net, vocab):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "head.safetensors"
    head_files.save_head(path, head_weights(net), vocab, model, "test: fitted on the model's greedy text")
    return str(path)


def _net_probs(net, model, vocab, hidden, root):
    table = model.get_input_embeddings().weight.detach().float()
    with torch.no_grad():
        scores = net(hidden.float().view(1, -1), table[root].view(1, -1))[0] @ table[vocab].T
    return torch.softmax(scores, 0)


def test_fit_learns_to_predict_the_models_next_choice(trained):
    _, _, _, report, _ = trained
    assert report["top1"][-1] > 0.3  # chance is 1/32; measured ~0.5
    assert report["top1"][-1] > report["top1"][0]


def test_head_computes_what_the_trained_net_computes(trained):
    model, net, vocab, _, _ = trained
    generator = torch.Generator().manual_seed(0)
    exact = DraftHead(head_weights(net), vocab, model.get_input_embeddings().weight.double())  # fp32 products
    near = DraftHead(head_weights(net), vocab, model.get_input_embeddings().weight)  # int8 where available
    for root in (0, 5, 31):
        hidden = torch.randn(32, generator=generator)
        probs = _net_probs(net, model, vocab, hidden, root)
        top = torch.topk(probs, 3)
        got = exact.propose(hidden, root, 3)
        assert got.tokens.tolist() == vocab[top.indices].tolist()
        np.testing.assert_allclose(got.probs, top.values.numpy(), rtol=1e-4, atol=1e-6)
        approx = near.propose(hidden, root, 1)
        assert abs(float(approx.probs[0]) - float(probs[vocab == int(approx.tokens[0])][0])) < 0.03


@pytest.mark.skipif(not streamed_gemm.available(), reason="needs the streamed kernel (LLVM, FMA)")
def test_compiled_head_computes_what_its_operations_compute(trained):
    """The one-call forward (`head_kernel`) against the same int8 products run as PyTorch operations."""
    model, net, vocab, _, _ = trained
    head = DraftHead(head_weights(net), vocab, model.get_input_embeddings().weight)
    assert head.compiled is not None
    generator = torch.Generator().manual_seed(1)
    for root in range(VOCAB):
        hidden = torch.randn(32, generator=generator) * 2
        fast = head.propose(hidden, root, 4)
        compiled, head.compiled = head.compiled, None
        slow = head.propose(hidden, root, 4)
        head.compiled = compiled
        assert fast.tokens.tolist() == slow.tokens.tolist()
        np.testing.assert_allclose(fast.probs, slow.probs, rtol=1e-4, atol=1e-6)
    assert len(head.propose(torch.full((32,), float("nan")), 3, 4).tokens) == 0  # nothing ranked, nothing proposed


def test_head_file_is_tied_to_its_model(trained, tmp_path):
    model, net, vocab, _, path = trained
    assert head_files.read_metadata(path)["fingerprint"] == head_files.model_fingerprint(model)
    assert isinstance(head_files.load_head(path, model), DraftHead)
    other = build_tiny_model("llama", dtype=torch.float32, seed=4, vocab=VOCAB)
    with pytest.raises(ValueError, match="was made for"):
        head_files.load_head(path, other)
    not_a_head = tmp_path / "x.safetensors"
    not_a_head.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable draft head"):
        head_files.load_head(not_a_head, model)
    with pytest.raises(ValueError, match="does not exist"):
        head_files.head_for(model, str(tmp_path / "missing.safetensors"))
    assert head_files.find_head(other) is None  # no packaged head for a random model
    with pytest.raises(ValueError, match="no draft head ships for this model"):
        head_files.head_for(other, "auto")
    bad = head_weights(net)
    bad["fc.bias"] = bad["fc.bias"][:-1]
    with pytest.raises(ValueError, match="fc"):
        DraftHead(bad, vocab, model.get_input_embeddings().weight)


def test_hidden_tap_records_what_the_lm_head_reads():
    model = build_tiny_model("qwen2", dtype=torch.float64, seed=2, vocab=VOCAB)
    prompt = repetitive_prompt(1, vocab=VOCAB)
    with hidden_tap(model) as tap, torch.no_grad():
        out = model(prompt, output_hidden_states=True)
        seen = tap.take()
    assert len(seen) == 1 and torch.equal(seen[0], out.hidden_states[-1])
    with torch.no_grad():
        model(prompt)
    assert tap.take() == []  # the hook is gone after the block
    with hidden_tap(model, enabled=False) as off:
        assert off is None


def test_head_reads_the_hidden_state_of_the_row_that_chose_the_root(trained, monkeypatch):
    """Every proposal's hidden state is the model's own last hidden state at the position before the root."""
    model, _, _, _, path = trained
    calls = []
    original = DraftHead.propose
    monkeypatch.setattr(DraftHead, "propose", lambda self, hidden, root, k: calls.append((hidden.clone(), root))
                        or original(self, hidden, root, k))
    prompt = repetitive_prompt(7, vocab=VOCAB)
    decoder = Lookahead(draft_head=path, adaptive=False)  # the whole tree every step: steps commit several tokens
    out = model.generate(prompt, do_sample=False, max_new_tokens=30, custom_generate=decoder)[0]
    assert max(decoder.last_stats.tokens_per_step) > 1
    with torch.no_grad():
        states = model(out[None], output_hidden_states=True).hidden_states[-1][0]
    assert len(calls) >= 5
    text = out.tolist()
    for hidden, root in calls:
        # the root is the last committed token: find where it sits by the hidden state that chose it
        matches = [i for i in range(prompt.shape[1] - 1, len(text) - 1)
                   if text[i + 1] == root and torch.allclose(states[i], hidden, atol=1e-4)]
        assert matches, "a proposal read a hidden state that did not choose its root"


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_greedy_with_the_head_is_identical_and_its_drafts_are_accepted(family):
    model = build_tiny_model(family, dtype=torch.float32, seed=5, vocab=VOCAB)
    net, vocab, _ = _trained(model, epochs=15)
    path = _save(model, net, vocab)
    accepted = 0
    for seed in range(3):
        prompt = repetitive_prompt(seed + 40, vocab=VOCAB)
        plain = model.generate(prompt, do_sample=False, max_new_tokens=40)
        decoder = Lookahead(draft_head=path, prompt_candidates=0, pool_candidates=0)
        fast = model.generate(prompt, do_sample=False, max_new_tokens=40, custom_generate=decoder)
        assert torch.equal(plain, fast)
        accepted += decoder.last_stats.accepted_by_drafter.get("head", 0)
    assert accepted > 0


def test_seeded_sampling_with_the_head_is_identical_to_plain(trained):
    model, _, _, _, path = trained
    kwargs = dict(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=40)
    for seed in (0, 7):
        prompt = repetitive_prompt(seed, vocab=VOCAB)
        fast = Lookahead(LookaheadConfig(seed=seed, draft_head=path))
        spec = model.generate(prompt, custom_generate=fast, **kwargs)
        plain = model.generate(prompt, custom_generate=Lookahead(LookaheadConfig.off().with_overrides(seed=seed)),
                               **kwargs)
        assert torch.equal(spec, plain)


def test_batched_greedy_with_the_head_is_identical(trained):
    model, _, _, _, path = trained
    prompts = [repetitive_prompt(s, vocab=VOCAB, length=n)[0] for s, n in ((1, 16), (2, 24), (3, 12))]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]).long() for p in prompts])
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
    plain = model.generate(ids, **kwargs)
    fast = model.generate(ids, custom_generate=Lookahead(draft_head=path), **kwargs)
    assert torch.equal(plain, fast)


def test_head_sources_are_their_own_classes():
    assert SOURCE_DRAFTER[HEAD:HEAD + HEAD_SOURCES] == ("head",) * HEAD_SOURCES
    assert SOURCE_DRAFTER.count("head") == HEAD_SOURCES


def test_distill_writes_the_models_own_greedy_text():
    model = build_tiny_model("llama", dtype=torch.float32, seed=6, vocab=VOCAB)
    tokenizer = word_tokenizer(VOCAB)
    tokenizer.eos_token = "w2"
    examples = distill(model, tokenizer, sequences=6, batch=2, user_tokens=6, answer_tokens=8, passage_tokens=5,
                       kinds=("chat", "plain", "grounded"))
    assert len(examples) == 6
    for example in examples:
        with torch.no_grad():
            out = model(example.ids[None], output_hidden_states=True)
        assert torch.equal(example.argmax, out.logits[0].argmax(-1))
        assert example.hidden.shape == (len(example.ids), 32) and example.hidden.dtype == torch.float16
    for i, example in enumerate(examples[4:]):  # the grounded batch: a sampled passage, then the request about it
        user = tokenizer.decode(example.ids).split(" w2 ")[0].split()
        request = GROUNDED_REQUESTS[i].split()
        assert user[0] == "w1" and user[-len(request):] == ["w0"] * len(request)  # the request's words are unknown
        assert len(user) >= 1 + 1 + len(request)  # the passage: its opening (unknown here) and what was sampled
    with pytest.raises(ValueError, match="kinds"):
        distill(model, tokenizer, sequences=2, kinds=("poems",))


def test_distill_in_another_dtype_labels_with_that_copy_and_leaves_the_model_alone():
    """`dtype`: a bfloat16 copy writes the texts (its own greedy answers) and gives the labels and hidden states."""
    model = build_tiny_model("llama", dtype=torch.float32, seed=6, vocab=VOCAB)
    tokenizer = word_tokenizer(VOCAB)
    tokenizer.eos_token = "w2"
    examples = distill(model, tokenizer, sequences=4, batch=2, user_tokens=6, answer_tokens=8, passage_tokens=5,
                       kinds=("chat", "plain"), dtype=torch.bfloat16)
    assert model.dtype == torch.float32 and len(examples) == 4
    copy16 = copy.deepcopy(model).to(torch.bfloat16)
    for example in examples:
        with torch.no_grad(), hidden_tap(copy16) as tap:
            argmax = copy16(example.ids[None]).logits[0].argmax(-1)
            hidden = tap.last()[0].to(torch.float16)
        assert torch.equal(example.argmax, argmax) and torch.equal(example.hidden, hidden)


def test_headnet_starts_as_the_fc_alone():
    net = HeadNet(8, 16, blocks=2)
    hidden, embedded = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        assert torch.allclose(net(hidden, embedded), net.fc(torch.cat([hidden, embedded], -1)))



def test_fit_trains_on_from_a_head(trained):
    """`start`: the net begins as the given head (its vocabulary kept), not from scratch."""
    model, net, vocab, report, _ = trained
    examples = _examples(model, 12)
    table = model.get_input_embeddings().weight
    on, on_vocab, on_report = fit(examples, table, epochs=1, inter=64, lr=1e-7, held_out=0.5,
                                  start=(head_weights(net), vocab))
    fresh, _, fresh_report = fit(examples, table, vocab_size=VOCAB, epochs=1, inter=64, lr=1e-7, held_out=0.5)
    assert torch.equal(on_vocab, vocab)
    assert on_report["top1"][0] > 0.3 and fresh_report["top1"][0] < 0.2  # measured ~0.5 / ~0.03; chance 1/32
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(head_weights(on).values(), head_weights(net).values()))


def test_headnet_from_weights_is_the_same_function():
    net = HeadNet(8, 12, blocks=2)
    torch.nn.init.normal_(net.downs[1].weight)
    copy = HeadNet.from_weights(head_weights(net))
    hidden, embedded = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(copy(hidden, embedded), net(hidden, embedded)) and len(copy.norms) == 2
