"""The external draft-model mode: exactness (greedy token for token, sampling in law, seeded as an equality),
the draft's KV-cache rollback, vocabulary checks and the self-speculative early-exit draft.

Statistical checks use ALPHA = 1e-4 with fixed seeds (deterministic suite); negative controls swap in wrong
acceptance rules and must be rejected with p < NEGATIVE_P.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampling import Target, chi_square_p
from test_sampling_model import pooled_chisquare_p
from tiny_models import build_tiny_model, repetitive_prompt

from lookahead import Lookahead, LookaheadConfig
from lookahead import verify
from lookahead.draft_model import ModelDrafter, check_draft_model, check_same_tokenizer, early_exit_draft
from lookahead.tree import DraftTree
from lookahead.verify import verify_point_mass

ALPHA = 1e-4
NEGATIVE_P = 1e-12
DRAFT_ONLY = LookaheadConfig.off().with_overrides(tree_budget=16)
CONFIGS = {"draft_only": DRAFT_ONLY, "with_model_free": LookaheadConfig(),
           "not_adaptive": LookaheadConfig(adaptive=False, draft_tokens=6)}


@pytest.fixture(scope="module")
def target():
    return build_tiny_model("llama", layers=3)


def _drafts(target):
    """name -> draft model sharing the target's vocabulary."""
    return {"other_model": build_tiny_model("llama", seed=1), "itself": target,
            "early_exit": early_exit_draft(target, 2), "qwen2": build_tiny_model("qwen2", seed=2)}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("draft", ["other_model", "itself", "early_exit", "qwen2"])
def test_greedy_with_a_draft_model_is_token_identical(target, config, draft):
    decoder = Lookahead(CONFIGS[config], draft_model=_drafts(target)[draft])
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        expected = target.generate(prompt, max_new_tokens=33, do_sample=False)
        out = target.generate(prompt, max_new_tokens=33, do_sample=False, custom_generate=decoder)
        assert torch.equal(out, expected), (config, draft, seed)


def test_a_perfect_draft_is_accepted_every_step(target):
    decoder = Lookahead(DRAFT_ONLY, draft_model=target, draft_tokens=4, adaptive=False)
    target.generate(repetitive_prompt(0), max_new_tokens=41, do_sample=False, custom_generate=decoder)
    stats = decoder.last_stats
    assert stats.steps == 8 and stats.mean_tokens_per_step == 5.0
    assert stats.accepted_by_drafter["draft_model"] == 32


def test_greedy_with_processors_and_left_padding(target):
    draft = build_tiny_model("llama", seed=1)
    prompt = repetitive_prompt(4)
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)], dim=1)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, repetition_penalty=1.3,
                  no_repeat_ngram_size=3)
    expected = target.generate(ids, **kwargs)
    decoder = Lookahead(draft_model=draft)
    assert torch.equal(target.generate(ids, custom_generate=decoder, **kwargs), expected)


def test_drafter_rolls_its_cache_back_to_the_committed_text(target):
    """After proposals on diverging texts, a drafter's chain equals a fresh drafter's on the same text."""
    draft = build_tiny_model("llama", seed=1)
    pick = lambda scores, index: (int(scores.argmax()), None)  # noqa: E731
    reused = ModelDrafter(draft, 5, pick)

    def check(text):
        chain = reused.propose(text, 5).tokens
        assert chain.tolist() == ModelDrafter(draft, 5, pick).propose(text, 5).tokens.tolist()
        assert reused.cache.get_seq_length() == len(reused.cached) == len(text) + len(chain) - 1
        return chain

    text = repetitive_prompt(2)[0].numpy()
    chain = check(text)
    text = np.concatenate([text, chain[:2], [(int(chain[2]) + 1) % 64]])  # two accepted, then a different bonus
    chain = check(text)
    text = np.concatenate([text, chain])  # the whole chain accepted (its last token was never fed)
    check(text)
    check(text[:-7])  # back into the prompt
    check(text[:4])


def test_drafter_respects_max_len_and_skip(target):
    pick = lambda scores, index: (int(scores.argmax()), None)  # noqa: E731
    text = repetitive_prompt(1)[0].numpy()
    drafter = ModelDrafter(target, 6, pick, skip=3)
    assert len(drafter.propose(text, 2).tokens) == 2 and len(drafter.propose(text, 0).tokens) == 0
    assert drafter.cache.get_seq_length() == len(text) - 3 + 1


def test_vocabulary_mismatch_is_refused(target):
    with pytest.raises(ValueError, match="vocabulary mismatch: the target has 64 tokens, the draft 80"):
        check_draft_model(target, build_tiny_model("llama", vocab=80))
    decoder = Lookahead(draft_model=build_tiny_model("llama", vocab=80))
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        target.generate(repetitive_prompt(0), max_new_tokens=4, custom_generate=decoder)


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


@pytest.mark.parametrize("draft_vocab, message", [
    ({"a": 0, "b": 2, "c": 1}, "token 'b' is id 1 in the target, 2 in the draft"),
    ({"a": 0, "b": 1}, "token 'c' is missing from the draft"),
    ({"a": 0, "b": 1, "c": 2, "d": 3}, "token 'd' is not in the target"),
])  # fmt: skip
def test_tokenizer_mismatch_names_the_token(draft_vocab, message):
    target = FakeTokenizer({"a": 0, "b": 1, "c": 2})
    check_same_tokenizer(target, FakeTokenizer({"a": 0, "b": 1, "c": 2}))
    with pytest.raises(ValueError, match=message):
        check_same_tokenizer(target, FakeTokenizer(draft_vocab))


def test_early_exit_draft_is_the_first_layers_with_the_final_norm_and_head(target):
    draft = early_exit_draft(target, 2)
    prompt = repetitive_prompt(3)
    with torch.no_grad():
        hidden = target(prompt, output_hidden_states=True).hidden_states[2]
        expected = target.lm_head(target.model.norm(hidden))
        assert torch.allclose(draft(prompt).logits, expected, atol=1e-10)
    assert draft.lm_head is target.lm_head and draft.model.layers[1] is target.model.layers[1]


def test_early_exit_draft_rejects_bad_layers_and_models(target):
    for layers in (0, 3):
        with pytest.raises(ValueError, match=r"draft layers must be in \[1, 2\]"):
            early_exit_draft(target, layers)
    with pytest.raises(ValueError, match="Llama-style model"):
        early_exit_draft(build_tiny_model("gpt2"), 1)


@pytest.mark.parametrize("seed", [0, 5])
@pytest.mark.parametrize("draft", ["other_model", "early_exit"])
def test_seeded_sampling_with_a_draft_model_equals_the_plain_seeded_loop(target, seed, draft):
    prompt = repetitive_prompt(seed)
    kwargs = dict(do_sample=True, temperature=0.8, top_k=20, max_new_tokens=40)
    plain = target.generate(prompt, custom_generate=Lookahead(LookaheadConfig.off(), seed=seed), **kwargs)
    decoder = Lookahead(seed=seed, draft_model=_drafts(target)[draft])
    assert torch.equal(target.generate(prompt, custom_generate=decoder, **kwargs), plain)


# --- the mixed rule (sampled draft + point-mass drafts) on synthetic distributions -------------------------

VOCAB = 5
POINT_MASS = [[1, 3], [2], [4, 0]]  # fixed model-free drafts, merged with the sampled chain


def _draw_with_sampled_chain(n_draws: int, seed: int) -> tuple[dict, Target]:
    """Counts of the first two emitted tokens when each step drafts a 2-token chain from q plus POINT_MASS."""
    p, q = Target(VOCAB, seed=1), Target(VOCAB, seed=2)
    generator, counts = torch.Generator().manual_seed(seed), {}
    for _ in range(n_draws):
        context: tuple = ()
        while len(context) < 2:
            chain, qs = [], []
            for _ in range(2):
                dist = q(context + tuple(chain))
                chain.append(int(torch.multinomial(dist, 1, generator=generator)))
                qs.append(dist)
            tree = DraftTree.from_paths(context[-1] if context else 0, [chain, *POINT_MASS], [5, 0, 0, 0], 64)
            sampled, node = {}, 0
            for token, dist in zip(chain, qs):
                sampled[node] = (token, dist)
                node = tree.children[node][token]
            verdict = verify_point_mass(tree, lambda node, path: p(context + tuple(path)), generator, sampled)
            context += tuple(verdict.tokens)
        counts[context[:2]] = counts.get(context[:2], 0) + 1
    return counts, p


def test_sampled_draft_chain_matches_the_target_distribution():
    counts, p = _draw_with_sampled_chain(6000, seed=0)
    assert chi_square_p(counts, p.joint(2)) > ALPHA


def _accept_always(probs, draft, q, others, generator):
    torch.rand(1, generator=generator)
    return draft


def _residual_without_q(probs, draft, q, others, generator):
    u = float(torch.rand(1, generator=generator, dtype=torch.float64))
    if u * float(q[draft]) < float(probs[draft]):
        return draft
    return verify.sample_point_mass(probs.clone().index_fill_(0, torch.tensor([draft]), 0.0), others, generator)


def _bonus_from_target(probs, draft, q, others, generator):  # on rejection draw from p itself
    u = float(torch.rand(1, generator=generator, dtype=torch.float64))
    if u * float(q[draft]) < float(probs[draft]):
        return draft
    return verify.sample_point_mass(probs, others, generator)


# Not a wrong rule: accepting a sampled x with probability p(x) and zeroing it on rejection is the point-mass rule,
# exact for ANY draft chosen independently of the acceptance draws (only less efficient than min(1, p/q)).
def _point_mass_rule_for_the_sampled_draft(probs, draft, q, others, generator):
    return verify.sample_point_mass(probs, [draft, *others], generator)


def test_point_mass_rule_is_also_exact_for_a_sampled_draft(monkeypatch):
    monkeypatch.setattr(verify, "sample_with_draft", _point_mass_rule_for_the_sampled_draft)
    counts, p = _draw_with_sampled_chain(6000, seed=2)
    assert chi_square_p(counts, p.joint(2)) > ALPHA


@pytest.mark.parametrize("wrong_rule", [_accept_always, _residual_without_q, _bonus_from_target])
def test_negative_control_wrong_draft_rule_is_detected(monkeypatch, wrong_rule):
    monkeypatch.setattr(verify, "sample_with_draft", wrong_rule)
    counts, p = _draw_with_sampled_chain(3000, seed=1)
    assert chi_square_p(counts, p.joint(2)) < NEGATIVE_P


def test_sample_with_draft_refuses_a_draft_q_never_proposes():
    probs = torch.tensor([0.5, 0.5], dtype=torch.float64)
    with pytest.raises(ValueError, match="probability 0 under its own q"):
        verify.sample_with_draft(probs, 1, torch.tensor([1.0, 0.0]), [], torch.Generator().manual_seed(0))


def test_joint_law_of_first_two_tokens_with_a_sampled_draft_model():
    """(b) with a draft model: the first two sampled tokens follow the model's exact joint law."""
    model = build_tiny_model("llama", seed=11, vocab=6)
    draft = build_tiny_model("llama", seed=12, vocab=6, layers=1)
    prompt = repetitive_prompt(0, vocab=6, length=16)
    with torch.no_grad():
        first = torch.softmax(model(prompt).logits[0, -1] / 1.3, -1)
        both = torch.cat([prompt.repeat(6, 1), torch.arange(6).view(-1, 1)], dim=1)
        expected = (first[:, None] * torch.softmax(model(both).logits[:, -1] / 1.3, -1)).reshape(-1).numpy()
    torch.manual_seed(4321)
    decoder = Lookahead(adaptive=False, prompt_candidates=2, window_levels=0, draft_model=draft, draft_tokens=3)
    counts, from_draft, draws = np.zeros(36), 0, 1500
    for _ in range(draws):
        out = model.generate(prompt, do_sample=True, temperature=1.3, top_k=0, max_new_tokens=3,
                             custom_generate=decoder)
        t1, t2 = out[0, prompt.shape[1]: prompt.shape[1] + 2].tolist()
        counts[t1 * 6 + t2] += 1
        from_draft += decoder.last_stats.accepted_by_drafter["draft_model"]
    assert from_draft > draws // 4, "the draft model's chain must really be accepted for this test to mean anything"
    assert pooled_chisquare_p(counts, expected) > ALPHA
