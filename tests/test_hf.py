"""`Lookahead` as `custom_generate`, and `patch` / `unpatch`: same arguments, same results, clear refusals."""

from __future__ import annotations

import contextlib
import copy
import threading
import time

import pytest
import torch
from tiny_models import build_tiny_model as tiny_model, repetitive_prompt
from transformers import (AutoTokenizer, GenerationConfig, LlamaConfig, LlamaModel, LogitsProcessor,
                          LogitsProcessorList, StoppingCriteria, StoppingCriteriaList)
from transformers.generation.streamers import BaseStreamer

import lookahead
from lookahead import Lookahead, LookaheadConfig


class Recorder(BaseStreamer):
    """Collects every put() call."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


@pytest.fixture()
def model():
    return tiny_model("llama", dtype=torch.float64, seed=2)


def test_patch_makes_generate_use_lookahead_and_unpatch_restores(model):
    prompt = repetitive_prompt(0)
    plain = model.generate(prompt, max_new_tokens=30, do_sample=False)
    decoder = lookahead.patch(model)
    patched = model.generate(prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(plain, patched)
    assert decoder.last_stats is not None and decoder.last_stats.new_tokens == 30
    lookahead.unpatch(model)
    decoder.last_stats = None
    assert torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False), plain)
    assert decoder.last_stats is None  # the unpatched model no longer goes through lookahead


def test_patch_refuses_twice_and_unpatch_refuses_unpatched(model):
    lookahead.patch(model)
    with pytest.raises(ValueError, match="already patched"):
        lookahead.patch(model)
    lookahead.unpatch(model)
    with pytest.raises(ValueError, match="not patched"):
        lookahead.unpatch(model)


def test_patch_is_instance_level(model):
    other = tiny_model("llama", dtype=torch.float64, seed=2)
    lookahead.patch(model)
    assert "generate" not in other.__dict__
    lookahead.unpatch(model)


@pytest.mark.parametrize("thing", [object(), torch.nn.Linear(2, 2)])
def test_patch_refuses_non_generative_objects(thing):
    with pytest.raises(ValueError, match="generative"):
        lookahead.patch(thing)


def test_patch_refuses_base_model_without_lm_head():
    base = LlamaModel(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="generative"):
        lookahead.patch(base)


def test_patch_accepts_config_overrides_and_rejects_unknown(model):
    decoder = lookahead.patch(model, tree_budget=3)
    assert decoder.config.tree_budget == 3
    lookahead.unpatch(model)
    with pytest.raises(ValueError, match="unknown lookahead option"):
        lookahead.patch(model, tree_bugdet=3)


def test_streamer_receives_prompt_then_accepted_tokens(model):
    prompt = repetitive_prompt(1)
    lookahead.patch(model)
    streamer = Recorder()
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, streamer=streamer)
    lookahead.unpatch(model)
    assert streamer.puts[0] == prompt[0].tolist()
    assert sum(streamer.puts[1:], []) == out[0, prompt.shape[1]:].tolist()
    assert any(len(p) > 1 for p in streamer.puts[1:])  # several tokens per step arrive together
    assert streamer.ended


def test_return_dict_in_generate_gives_sequences(model):
    prompt = repetitive_prompt(2)
    plain = model.generate(prompt, max_new_tokens=20, do_sample=False)
    out = model.generate(prompt, max_new_tokens=20, do_sample=False, return_dict_in_generate=True,
                         custom_generate=Lookahead())
    assert torch.equal(out.sequences, plain)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_beams=2), "beam search"),
    (dict(return_dict_in_generate=True, output_attentions=True), "output_attentions"),
    (dict(return_dict_in_generate=True, output_hidden_states=True), "output_hidden_states"),
    (dict(dola_layers="low"), "DoLa decoding"),
    (dict(penalty_alpha=0.6, top_k=4), "contrastive search"),
    (dict(force_words_ids=[[3]]), "constrained beam search"),
    (dict(num_beams=2, num_beam_groups=2, diversity_penalty=1.0), "group beam search"),
    (dict(use_cache=False), "use_cache=False"),
])
def test_unsupported_options_are_refused(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        model.generate(repetitive_prompt(0), max_new_tokens=5, custom_generate=Lookahead(), **kwargs)


def test_a_config_of_another_type_and_token_healing_are_refused(model):
    with pytest.raises(TypeError, match="config must be a LookaheadConfig"):
        Lookahead({"tree_budget": 4})
    lookahead.patch(model)
    with pytest.raises(ValueError, match="token_healing"):
        model.generate(repetitive_prompt(0), max_new_tokens=5, token_healing=True)
    lookahead.unpatch(model)


def test_generations_on_one_model_from_several_threads_run_one_at_a_time(model, monkeypatch):
    """Generation swaps the model's layers in and out for the call: concurrent calls on one patched model wait
    for each other (here each holds the swapped-in state for 50 ms) and all give plain greedy's tokens."""
    from lookahead import hf

    active, most, real = [0], [0], hf.generation_arithmetic

    @contextlib.contextmanager
    def held(*args, **kwargs):
        with real(*args, **kwargs) as described:
            active[0] += 1
            most[0] = max(most[0], active[0])
            time.sleep(0.05)
            try:
                yield described
            finally:
                active[0] -= 1

    monkeypatch.setattr(hf, "generation_arithmetic", held)
    plain = model.generate(repetitive_prompt(0), do_sample=False, max_new_tokens=16)
    lookahead.patch(model)
    outputs, errors = [], []

    def run():
        try:
            outputs.append(model.generate(repetitive_prompt(0), do_sample=False, max_new_tokens=16))
        except Exception as error:  # noqa: BLE001 — reported below
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lookahead.unpatch(model)
    assert not errors and len(outputs) == 3 and all(torch.equal(out, plain) for out in outputs)
    assert most[0] == 1


class _Interrupting(BaseStreamer):
    """A streamer that raises once `after` tokens were generated (as a reader that closed its pipe does)."""

    def __init__(self, after: int):
        self.after, self.seen, self.prompt_seen = after, 0, False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.seen += value.numel()
        if self.seen >= self.after:
            raise KeyboardInterrupt

    def end(self):
        pass


def test_an_interrupted_call_leaves_its_own_stats(model):
    """`last_stats` after a call a streamer interrupted: that call's tokens and time so far, not the last call's."""
    decoder, prompt = Lookahead(), repetitive_prompt(1)
    model.generate(prompt, max_new_tokens=40, do_sample=False, custom_generate=decoder)
    finished = decoder.last_stats
    with pytest.raises(KeyboardInterrupt):
        model.generate(prompt, max_new_tokens=40, do_sample=False, custom_generate=decoder,
                       lookahead_streamer=_Interrupting(after=5))
    stats = decoder.last_stats
    assert stats is not finished and 5 <= stats.new_tokens < finished.new_tokens  # what the streamer was sent
    assert stats.total_time >= stats.setup_time + stats.prefill_time > 0


def test_streamer_with_a_batch_is_refused(model):
    batch = torch.cat([repetitive_prompt(0), repetitive_prompt(1)])
    with pytest.raises(ValueError, match="streamer needs batch size 1"):
        model.generate(batch, max_new_tokens=5, custom_generate=Lookahead(), lookahead_streamer=object())


def test_patched_refuses_assistant_model_and_custom_generate(model):
    lookahead.patch(model)
    with pytest.raises(ValueError, match="assistant_model"):
        model.generate(repetitive_prompt(0), max_new_tokens=5, assistant_model=model)
    with pytest.raises(ValueError, match="custom_generate"):
        model.generate(repetitive_prompt(0), max_new_tokens=5, custom_generate=Lookahead())
    lookahead.unpatch(model)


def test_non_dynamic_cache_is_refused(model):
    with pytest.raises(ValueError, match="DynamicCache"):
        model.generate(repetitive_prompt(0), max_new_tokens=5, cache_implementation="static",
                       custom_generate=Lookahead())


@pytest.fixture(scope="module")
def tokenizer():
    from lookahead.models import default_model_folder

    return AutoTokenizer.from_pretrained(default_model_folder())


def test_stop_strings_work_through_patch(tokenizer):
    model = tiny_model("llama", dtype=torch.float32, seed=4, vocab=len(tokenizer))
    prompt = tokenizer("def add(a, b):\n    return a + b\n\ndef add(a, b):", return_tensors="pt").input_ids
    reference = model.generate(prompt, max_new_tokens=40, do_sample=False)
    text = tokenizer.decode(reference[0, prompt.shape[1]:])
    stop = text[len(text) // 2: len(text) // 2 + 3]
    plain = model.generate(prompt, max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    lookahead.patch(model)
    patched = model.generate(prompt, max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    lookahead.unpatch(model)
    assert torch.equal(plain, patched)
    assert plain.shape[1] < reference.shape[1]


def _stop_string_setup(tokenizer):
    """A tiny model, a code prompt and a stop string that ends its greedy continuation halfway."""
    model = tiny_model("llama", dtype=torch.float32, seed=4, vocab=len(tokenizer))
    prompt = tokenizer("def add(a, b):\n    return a + b\n\ndef add(a, b):", return_tensors="pt").input_ids
    text = tokenizer.decode(model.generate(prompt, max_new_tokens=40, do_sample=False)[0, prompt.shape[1]:])
    return model, prompt, text[len(text) // 2: len(text) // 2 + 3]


@pytest.mark.parametrize("route", ["positional config", "model config", "kwarg beats config", "None kwarg"])
def test_stop_strings_from_a_generation_config_work_through_patch(tokenizer, route):
    """Stop strings in a config passed positionally or set on the model stop the patched model like plain generate;
    an explicit kwarg overrides the config the same way in both."""
    model, prompt, stop = _stop_string_setup(tokenizer)
    config = GenerationConfig(max_new_tokens=40, do_sample=False, stop_strings=[stop])

    def generate():
        if route == "positional config":
            return model.generate(prompt, config, tokenizer=tokenizer)
        if route == "model config":
            model.generation_config = copy.deepcopy(config)
            return model.generate(prompt, tokenizer=tokenizer)
        other = GenerationConfig(max_new_tokens=40, do_sample=False, stop_strings=["never seen here"])
        return model.generate(prompt, other, stop_strings=[stop] if route == "kwarg beats config" else None,
                              tokenizer=tokenizer)

    saved = model.generation_config
    plain = generate()
    model.generation_config = saved
    lookahead.patch(model)
    patched = generate()
    assert torch.equal(plain, patched)
    assert plain.shape[1] < prompt.shape[1] + 40 or route == "None kwarg"


def test_config_is_validated():
    with pytest.raises(ValueError, match="tree_budget"):
        LookaheadConfig(tree_budget=-1)
    with pytest.raises(ValueError, match="window_columns"):
        LookaheadConfig(window_columns=0)
    with pytest.raises(ValueError, match="prompt_max_ngram"):
        LookaheadConfig(prompt_min_ngram=3, prompt_max_ngram=2)


def test_text_iterator_streamer_through_patch(tokenizer):
    """A TextIteratorStreamer (consumed from another thread, as in a web app) gets exactly the returned text."""
    import threading

    from transformers import TextIteratorStreamer

    model = tiny_model("llama", dtype=torch.float32, seed=6, vocab=len(tokenizer))
    prompt = tokenizer("def add(a, b):\n    return a + b\n\ndef add(a, b):", return_tensors="pt").input_ids
    lookahead.patch(model)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "out", model.generate(prompt, max_new_tokens=30, do_sample=False, streamer=streamer)))
    worker.start()
    streamed = "".join(streamer)
    worker.join()
    lookahead.unpatch(model)
    assert streamed == tokenizer.decode(result["out"][0, prompt.shape[1]:])


def test_generation_config_object_and_model_defaults(model):
    from transformers import GenerationConfig

    prompt = repetitive_prompt(3)
    config = GenerationConfig(max_new_tokens=17, do_sample=False, repetition_penalty=1.2)
    plain = model.generate(prompt, generation_config=config)
    model.generation_config.max_new_tokens = 9  # the model's own defaults apply when nothing is passed
    try:
        plain_default = model.generate(prompt, do_sample=False)
        lookahead.patch(model)
        assert torch.equal(model.generate(prompt, generation_config=config), plain)
        assert torch.equal(model.generate(prompt, do_sample=False), plain_default)
        assert plain_default.shape[1] == prompt.shape[1] + 9
    finally:
        if "_lookahead_patch" in model.__dict__:
            lookahead.unpatch(model)
        model.generation_config.max_new_tokens = None


class BanToken(LogitsProcessor):
    """Caller-supplied processor: token 5 never appears."""

    def __call__(self, input_ids, scores):
        scores[:, 5] = -float("inf")
        return scores


class StopAtLength(StoppingCriteria):
    """Caller-supplied criterion: stop at 37 tokens (has no eos_token_id)."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 37, dtype=torch.bool)


def _left_padded():
    prompts = [repetitive_prompt(3, length=24)[0], repetitive_prompt(4, length=17)[0]]
    ids = torch.zeros(2, 24, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, 24 - len(p):], mask[b, 24 - len(p):] = p, 1
    return ids, mask


COVERAGE = {
    "max_new_tokens": dict(max_new_tokens=20),
    "max_length": dict(max_length=40),
    "min_new_tokens_eos": dict(max_new_tokens=20, min_new_tokens=12, eos_token_id=9, pad_token_id=0),
    "min_length": dict(max_new_tokens=20, min_length=35, eos_token_id=[9, 11], pad_token_id=0),
    "eos_list": dict(max_new_tokens=30, eos_token_id=[9, 11, 17], pad_token_id=0),
    "logits_processor": dict(max_new_tokens=20, logits_processor=LogitsProcessorList([BanToken()])),
    "stopping_criteria": dict(max_new_tokens=30, stopping_criteria=StoppingCriteriaList([StopAtLength()])),
    "generation_config": dict(generation_config=GenerationConfig(max_new_tokens=15, repetition_penalty=1.3,
                                                                  no_repeat_ngram_size=2, do_sample=False)),
    "return_dict": dict(max_new_tokens=12, return_dict_in_generate=True),
    "attention_mask": dict(max_new_tokens=16, attention_mask=torch.ones(1, 24, dtype=torch.long)),
}  # fmt: skip


@pytest.mark.parametrize("batch", [False, True], ids=["single", "left_padded_batch"])
@pytest.mark.parametrize("case", list(COVERAGE))
def test_patched_equals_unpatched_full_output(model, case, batch):
    """The same generate call, unpatched then patched: the full output is equal (sequences, or the dict's)."""
    kwargs = dict(COVERAGE[case])
    if batch:
        ids, mask = _left_padded()
        kwargs.update(attention_mask=mask, pad_token_id=kwargs.get("pad_token_id", 0))
    else:
        ids = repetitive_prompt(3, length=24)
    plain = model.generate(ids, **kwargs)
    lookahead.patch(model, adaptive=False)
    try:
        patched = model.generate(ids, **kwargs)
    finally:
        lookahead.unpatch(model)
    if kwargs.get("return_dict_in_generate"):
        plain, patched = plain.sequences, patched.sequences
    assert torch.equal(plain, patched)


@pytest.mark.parametrize("options, rows", [({}, 17), ({"tree_budget": 8}, 9),
                                           ({"window_levels": 2, "window_columns": 3}, 17 + 6)])
def test_the_curve_is_asked_for_the_most_rows_a_step_verifies(model, monkeypatch, injected_cost_curve, options,
                                                             rows):
    from lookahead import hf

    asked = []
    monkeypatch.setattr(hf, "cost_curve_for", lambda model, batch=1, rows=None, **kwargs:
                        asked.append(rows) or injected_cost_curve)
    config = LookaheadConfig(**options)
    assert config.step_rows == rows
    model.generate(repetitive_prompt(1), do_sample=False, max_new_tokens=4, custom_generate=Lookahead(config))
    assert asked == [rows]


def test_a_fixed_cost_curve_replaces_the_measurement_and_the_timings(model, monkeypatch):
    """`Lookahead(cost_curve=...)` never measures, plans on that curve alone and stays exact: two runs take the
    same steps even though their forwards' timings differ."""
    from lookahead import budget, hf
    from lookahead.cost_curve import CURVE_SIZES, CostCurve

    monkeypatch.setattr(hf, "cost_curve_for", lambda *a, **k: pytest.fail("the fixed curve must not be measured"))
    # No step time ever reaches the planner: one that still followed timings would wait for a plain reference step
    # forever and never verify a draft.
    monkeypatch.setattr(budget.BatchPlanner, "record", lambda self, rows, seconds: None)
    curve = CostCurve(CURVE_SIZES, tuple(1.0 + 0.01 * (k - 1) for k in CURVE_SIZES), 0.05)  # rows nearly free
    prompt = repetitive_prompt(1)
    expected = model.generate(prompt, do_sample=False, max_new_tokens=24)
    runs = []
    for _ in range(2):
        decoder = Lookahead(cost_curve=curve)
        assert torch.equal(model.generate(prompt, do_sample=False, max_new_tokens=24, custom_generate=decoder),
                           expected)
        runs.append((decoder.last_stats.steps, decoder.last_stats.rows_verified))
    assert runs[0] == runs[1] and runs[0][1] > runs[0][0]  # the first step already verifies drafts
    with pytest.raises(TypeError, match="CostCurve"):
        Lookahead(cost_curve=[1.0, 1.1])


def test_a_draft_model_that_is_not_a_model_is_refused_when_built():
    with pytest.raises(TypeError, match="draft_model must be a loaded transformers causal LM.*got str"):
        Lookahead(draft_model="path/to/draft")
