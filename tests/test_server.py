"""`lookahead.server` over real HTTP on loopback: the `openai` client for completions, chat and streaming, raw
httpx for bad input, concurrency, disconnects and the cross-request suffix cache.

The served model is a tiny random Llama (fp64, so no float near-tie can make two exact decoders differ) with
the REAL default tokenizer, loaded once per module together with the default model (used by the last test).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from openai import OpenAI
from server_helpers import one_thread, serving as _serving  # noqa: F401  (one_thread: autouse fixture)
from tiny_models import build_tiny_model

from lookahead import Lookahead, LookaheadConfig, load_model
from lookahead.server import ServerSettings, create_app, model_name_for
from lookahead.server_engine import Sampling, sampling_kwargs
from lookahead.server_text import first_stop, stable_length
from lookahead.suffix_cache import SuffixCache

NAME = "tiny"
CONTEXT = 256
MAX_BODY = 64 * 1024
PROMPTS = [
    "def add(a, b):\n    return",
    "The quick brown fox",
    "import numpy as np\n\nx = np.",
    "Once upon a time, in a land far away,",
    "SELECT name FROM users WHERE",
    "# TODO: fix the bug in",
    "<html><body><h1>",
    "Dear Sir or Madam,\n\n",
]


@pytest.fixture(scope="module")
def default_model():
    """(model, tokenizer) of the embedded default model."""
    return load_model()


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model[1]


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return build_tiny_model(vocab=len(tokenizer), dtype=torch.float64, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def served(tiny, tokenizer):
    """(base URL, app) of a server for the tiny model with a suffix cache."""
    settings = ServerSettings(model_name=NAME, max_body_bytes=MAX_BODY)
    app = create_app(tiny, tokenizer, settings, SuffixCache(max_tokens=4096))
    with _serving(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def client(url):
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _reference_ids(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """New tokens of `lookahead generate --mode off` for prompt `ids` (the same generate call)."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         custom_generate=Lookahead(LookaheadConfig.off()))
    return out[0, len(ids):].tolist()


def _reference(model, tokenizer, text: str, max_new_tokens: int) -> str:
    ids = tokenizer(text).input_ids
    return tokenizer.decode(_reference_ids(model, ids, max_new_tokens), skip_special_tokens=True)


def _chat_text(tokenizer, content: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


# -- plain functions -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, stops, first, stable", [
    ("abc", (), None, 3),
    ("ab\n", ("\n\n",), None, 2),          # "\n" may become a stop string: hold it back
    ("ab\n\ncd", ("\n\n",), 2, 2),         # never send the stop string or what follows
    ("ab\ufffd", (), None, 2),             # an incomplete UTF-8 character waits for its next byte
    ("abc", ("cd", "bcx"), None, 1),       # the longest tail that is a stop prefix is held
    ("xySTOPz", ("z", "STOP"), 2, 2),      # the earliest stop string wins
])
def test_stop_text_helpers(text, stops, first, stable):
    assert first_stop(text, stops) == first
    assert stable_length(text, stops) == stable


def test_sampling_kwargs():
    assert sampling_kwargs(Sampling(temperature=0.0, top_p=1.0, seed=None)) == {"do_sample": False}
    assert sampling_kwargs(Sampling(temperature=0.5, top_p=0.9, seed=1)) == {
        "do_sample": True, "temperature": 0.5, "top_p": 0.9, "top_k": 0}


def test_settings_and_names():
    with pytest.raises(ValueError, match="max_queue"):
        ServerSettings(max_queue=0)
    with pytest.raises(ValueError, match="context_length"):
        ServerSettings(context_length=1)
    with pytest.raises(ValueError, match="prompt_cache_bytes"):
        ServerSettings(prompt_cache_bytes=-1)
    assert model_name_for(None) == "smollm2-135m-instruct"
    assert model_name_for("/models/Qwen2.5-Coder-0.5B/") == "Qwen2.5-Coder-0.5B"
    assert model_name_for("/models/tiny-q4.gguf") == "tiny-q4"


# -- the API through the openai client -----------------------------------------------------------------------

def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == [NAME]
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["model"] == NAME and health["queued"] == 0


def test_completion_equals_mode_off(client, tiny, tokenizer):
    prompt = PROMPTS[0]
    response = client.completions.create(model=NAME, prompt=prompt, max_tokens=24)
    assert response.choices[0].text == _reference(tiny, tokenizer, prompt, 24)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert response.usage.completion_tokens == 24
    stats = response.model_extra["lookahead"]
    assert stats["new_tokens"] == 24 and stats["tokens_per_step"] >= 1 and stats["fewer_threads_steps"] == 0


def test_seeded_sampling_is_reproducible_and_seed_dependent(client):
    def sample(seed):
        return client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0.9,
                                         top_p=0.95, seed=seed).choices[0].text
    first = sample(3)
    assert sample(3) == first
    assert any(sample(seed) != first for seed in (4, 5, 6))


def test_token_id_prompt_and_default_max_tokens(client, tiny, tokenizer):
    ids = [100, 200, 300, 400]
    response = client.completions.create(model=NAME, prompt=ids)  # OpenAI's default max_tokens is 16
    assert response.choices[0].text == tokenizer.decode(_reference_ids(tiny, ids, 16), skip_special_tokens=True)
    assert response.usage.prompt_tokens == 4 and response.usage.completion_tokens == 16


def test_streamed_completion_equals_whole(client):
    prompt = PROMPTS[1]
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=24)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert len(chunks) > 2  # tokens are streamed as steps commit them, not in one piece
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length"
    assert last.usage.completion_tokens == 24 and last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.model_extra["lookahead"]["new_tokens"] == 24


def test_chat_equals_mode_off_and_streams(client, tiny, tokenizer):
    content = "Write a function that reverses a string."
    messages = [{"role": "user", "content": content}]
    response = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20)
    expected = _reference(tiny, tokenizer, _chat_text(tokenizer, content), 20)
    assert response.choices[0].message.content == expected
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(tokenizer(_chat_text(tokenizer, content)).input_ids)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 20
    # content given as text parts and the newer max_completion_tokens field mean the same
    pieces = [{"type": "text", "text": content[:10]}, {"type": "text", "text": content[10:]}]
    parts = [{"role": "user", "content": pieces}]
    again = client.chat.completions.create(model=NAME, messages=parts, max_completion_tokens=20)
    assert again.choices[0].message.content == expected


def test_chat_takes_developer_role_and_null_assistant_content(client, tiny, tokenizer):
    """`developer` is OpenAI's newer name for `system`; an assistant turn may carry `"content": null`."""
    def template(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return _reference(tiny, tokenizer, text, 12)

    developer = [{"role": "developer", "content": "Answer in one word."}, {"role": "user", "content": "Colour?"}]
    answer = client.chat.completions.create(model=NAME, messages=developer, max_tokens=12)
    assert answer.choices[0].message.content == template([{**developer[0], "role": "system"}, developer[1]])
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
               {"role": "user", "content": "Colour?"}]
    answer = client.chat.completions.create(model=NAME, messages=history, max_tokens=12)
    assert answer.choices[0].message.content == template([history[0], {**history[1], "content": ""}, history[2]])


def test_stop_strings_end_the_completion_like_openai(client, tiny, tokenizer):
    prompt = PROMPTS[2]
    full = _reference(tiny, tokenizer, prompt, 32)
    stop = full[len(full) // 2: len(full) // 2 + 3]  # a piece of the text the model will produce
    expected = full[: full.index(stop)]
    response = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, stop=[stop, "\x00never"])
    assert response.choices[0].text == expected and response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < 32
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=32, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


# -- several samples, logprobs, fill-in-the-middle --------------------------------------------------------

def test_seeded_samples_are_the_one_sample_requests_with_seed_plus_index(client):
    def ask(**kwargs):
        return client.completions.create(model=NAME, prompt=PROMPTS[5], max_tokens=12, temperature=0.9, **kwargs)
    many = ask(n=3, seed=7)
    singles = [ask(seed=7 + i).choices[0].text for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == singles and len(set(singles)) > 1
    assert many.usage.completion_tokens == 36 and many.model_extra["lookahead"]["new_tokens"] == 36
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[5], max_tokens=12, temperature=0.9, n=3,
                                            seed=7, stream=True))
    for i, text in enumerate(singles):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == text
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 36


def test_greedy_samples_are_identical_copies_generated_once(client, tiny, tokenizer):
    response = client.completions.create(model=NAME, prompt=PROMPTS[6], max_tokens=10, n=3)
    expected = _reference(tiny, tokenizer, PROMPTS[6], 10)
    assert [c.text for c in response.choices] == [expected] * 3 and [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.completion_tokens == 30  # every returned choice counts, as OpenAI bills it
    assert response.model_extra["lookahead"]["new_tokens"] == 10  # the work done: one generation
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[6], max_tokens=10, n=3, stream=True))
    for i in range(3):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == expected
    assert chunks[-1].choices[0].index == 2 and chunks[-1].usage.completion_tokens == 30


def _log_softmax_reference(model, ids: list[int], new: list[int]) -> torch.Tensor:
    """[len(new), V] log-probabilities of the positions that chose `new` after prompt `ids` (one forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + new])).logits[0, len(ids) - 1: -1]
    return torch.log_softmax(logits.double(), dim=-1)


def test_logprobs_are_the_models_log_probabilities(client, tiny, tokenizer):
    # generate records float32 logits (as plain generate does): equal to the fp64 forward to ~1e-7
    prompt, k = PROMPTS[2], 3
    ids = tokenizer(prompt).input_ids
    new = _reference_ids(tiny, ids, 10)
    reference = _log_softmax_reference(tiny, ids, new)
    choice = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, logprobs=k).choices[0]
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in new]
    assert logprobs.token_logprobs == pytest.approx([reference[i, t].item() for i, t in enumerate(new)], abs=1e-5)
    assert logprobs.text_offset == [len(tokenizer.decode(new[:i]).rstrip("\ufffd")) for i in range(len(new))]
    for i, top in enumerate(logprobs.top_logprobs):
        best = reference[i].topk(k)
        assert set(top) == {tokenizer.decode([t]) for t in [*best.indices.tolist(), new[i]]}
        assert sorted(top.values(), reverse=True)[:k] == pytest.approx(best.values.tolist(), abs=1e-5)
        assert logprobs.token_logprobs[i] == pytest.approx(best.values[0].item(), abs=1e-5)  # greedy: the top


def test_logprobs_end_with_the_returned_text(client, tiny, tokenizer):
    prompt = PROMPTS[2]
    full = _reference(tiny, tokenizer, prompt, 32)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    choice = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, stop=stop, logprobs=0).choices[0]
    assert choice.finish_reason == "stop" and choice.text == full[: full.index(stop)]
    offsets = choice.logprobs.text_offset
    assert offsets and offsets[-1] < len(choice.text) and len(offsets) < 32
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs)  # logprobs=0: the returned token only
    sampled = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0.9, seed=2, n=2,
                                        logprobs=1)
    assert [len(c.logprobs.tokens) for c in sampled.choices] == [8, 8]


def test_suffix_without_fim_tokens_is_a_400_that_says_so(url):
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "def f(", "suffix": "):\n"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "suffix"
    assert "no fill-in-the-middle tokens" in error["message"] and "<|fim_prefix|>" in error["message"]


# -- bad input over raw HTTP -------------------------------------------------------------------------------

_LONG_IDS = list(range(1000, 1000 + CONTEXT + 5))


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"max_tokens": 5}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": 5}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": ["a", "b"]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [1, -3]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "7"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "model": "gpt-4"}', 404, "model"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 7}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "n": 0}', 400, "n"),
    ("/v1/completions", b'{"prompt": "hi", "n": 17}', 400, "n"),
    ("/v1/completions", b'{"prompt": "hi", "n": 2, "best_of": 3}', 400, "best_of"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 6}', 400, "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 2, "stream": true}', 400, "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "echo": true}', 400, "echo"),
    ("/v1/completions", b'{"prompt": [1, 2], "suffix": "x"}', 400, "suffix"),
    ("/v1/completions", b'{"prompt": "def f(", "suffix": "):"}', 400, "suffix"),  # no FIM tokens here
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', 400, "n"),
    ("/v1/completions", b'{"prompt": "hi", "stop": 3}', 400, "stop"),
    ("/v1/completions", json.dumps({"prompt": _LONG_IDS}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "word " * 300}).encode(), 400, "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"prompt": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', 400, "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', 400, "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": null}]}', 400, "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}', 400, "tools"),
    ("/v1/nowhere", b"{}", 404, None),
])
def test_bad_requests_get_openai_errors(url, path, body, status, param):
    response = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_method_and_size_limits(url):
    assert httpx.get(f"{url}/v1/completions").status_code == 405
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode()
    json_type = {"content-type": "application/json"}
    declared = httpx.post(f"{url}/v1/completions", content=big, headers=json_type)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 8192):
            yield big[i: i + 8192]

    streamed = httpx.post(f"{url}/v1/completions", content=chunks(), headers=json_type)
    assert streamed.status_code == 413
    assert httpx.get(f"{url}/health").json()["status"] == "ok"  # and the server lives on


# -- load, disconnects, the suffix cache -------------------------------------------------------------------

def test_eight_concurrent_clients_get_their_own_complete_output(client, tiny, tokenizer):
    expected = [_reference(tiny, tokenizer, p, 20) for p in PROMPTS]

    def ask(i: int) -> str:
        if i % 2:
            stream = client.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=20, stream=True)
            return "".join(c.choices[0].text for c in stream)
        return client.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=20).choices[0].text

    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == expected


def _wait_idle(app, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while app.state.engine.queued:
        assert time.monotonic() < deadline, "generation still running after its client left"
        time.sleep(0.05)


@contextlib.contextmanager
def _slowed(model, seconds: float):
    """Make every forward of `model` take at least `seconds` (so a generation outlives its client)."""
    handle = model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
    try:
        yield
    finally:
        handle.remove()


def test_client_disconnect_stops_generation(served, tiny):
    url, app = served
    body = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 200, "stream": True}
    with _slowed(tiny, 0.05):
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            assert next(line for line in response.iter_lines() if line.startswith("data:"))
        _wait_idle(app)
        last = app.state.engine.last_completion
        assert last.finish_reason == "cancelled" and last.completion_tokens < 200
        # a non-streaming client that gives up (its read timeout closes the connection) cancels its job too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body | {"stream": False}, timeout=httpx.Timeout(60, read=0.5))
        _wait_idle(app)
        last = app.state.engine.last_completion
        assert last.finish_reason == "cancelled" and last.completion_tokens < 200


def test_suffix_cache_speeds_up_a_similar_second_request(client, tiny, tokenizer):
    # A random model's output is not in its prompt: only the suffix cache can draft it the second time.
    prompt = [5000, 6000, 7000, 8000, 9000, 10000]
    ids = _reference_ids(tiny, prompt, 48)
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=48)
    # The client sends the prompt again with 6 accepted tokens typed in (as an editor does).
    second = client.completions.create(model=NAME, prompt=prompt + ids[:6], max_tokens=42)
    assert first.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    assert second.choices[0].text == tokenizer.decode(ids[6:], skip_special_tokens=True)
    first_rate = first.model_extra["lookahead"]["tokens_per_step"]
    second_rate = second.model_extra["lookahead"]["tokens_per_step"]
    assert second_rate >= max(2.5, 2 * first_rate), (first_rate, second_rate)
    assert second.model_extra["lookahead"]["accepted_by_drafter"].get("shared", 0) > 20


def test_a_resent_prompt_reuses_the_keys_and_values_of_the_one_before(client, url, tiny, tokenizer):
    prompt = [4100, 4200, 4300, 4400, 4500, 4600, 4700]
    ids = _reference_ids(tiny, prompt, 12)
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=12)
    kept = httpx.get(f"{url}/health").json()["prompt_cache"]  # this text and the earlier tests' requests
    assert kept["texts"] >= 1 and kept["tokens"] >= len(prompt) + 11 and 0 < kept["bytes"] <= kept["max_bytes"]
    # The client sends the prompt again with 4 accepted tokens and one of its own typed in (as an editor does).
    edited = prompt + ids[:4] + [(ids[4] + 1) % 1000]
    second = client.completions.create(model=NAME, prompt=edited, max_tokens=12)
    assert first.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    assert second.choices[0].text == tokenizer.decode(_reference_ids(tiny, edited, 12), skip_special_tokens=True)
    assert second.usage.prompt_tokens_details.cached_tokens == len(prompt) + 4
    assert second.model_extra["lookahead"]["prefill_seconds"] > 0
    other = client.completions.create(model=NAME, prompt=[7] + prompt, max_tokens=4)  # nothing shared
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_the_next_chat_turn_reuses_the_conversation_so_far(client, tiny, tokenizer):
    messages = [{"role": "user", "content": "Name three colours."}]
    first = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And three more."}]
    second = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert second.choices[0].message.content == _reference(tiny, tokenizer, text, 10)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens  # the first turn's prompt


def test_no_prompt_cache_when_its_bound_is_zero(tiny, tokenizer):
    app = create_app(tiny, tokenizer, ServerSettings(model_name=NAME, prompt_cache_bytes=0))
    body = {"prompt": PROMPTS[4], "max_tokens": 4}
    with _serving(app) as url:
        answers = [httpx.post(f"{url}/v1/completions", json=body, timeout=60).json() for _ in range(2)]
        assert httpx.get(f"{url}/health").json()["prompt_cache"] is None
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 0]
    assert answers[0]["choices"] == answers[1]["choices"]


def test_full_queue_answers_503(tiny, tokenizer, monkeypatch):
    app = create_app(tiny, tokenizer, ServerSettings(model_name=NAME, max_queue=1))
    engine, gate = app.state.engine, threading.Event()
    generate = engine._generate
    monkeypatch.setattr(engine, "_generate", lambda job: gate.wait(30) and generate(job))  # hold the worker
    body = {"prompt": PROMPTS[4], "max_tokens": 4}
    with _serving(app) as url, ThreadPoolExecutor(max_workers=2) as pool:
        admitted = []
        for queued in (1, 2):  # the running generation, then max_queue=1 waiting behind it
            admitted.append(pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60))
            deadline = time.monotonic() + 30
            while engine.queued < queued:
                assert time.monotonic() < deadline and not admitted[-1].done()
                time.sleep(0.02)
        busy = httpx.post(f"{url}/v1/completions", json=body)
        gate.set()
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
        assert busy.headers["retry-after"] == "1"
        assert [f.result().status_code for f in admitted] == [200, 200]


def test_default_model_end_to_end(default_model):
    model, tokenizer = default_model
    content = "What is the capital of France?"
    expected = _reference(model, tokenizer, _chat_text(tokenizer, content), 12)
    app = create_app(model, tokenizer, ServerSettings(), SuffixCache())
    with _serving(app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        response = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=12,
                                                  messages=[{"role": "user", "content": content}])
    assert response.choices[0].message.content == expected
    assert "Paris" in expected


@pytest.mark.parametrize("cache_requests", [True, False])
def test_requests_enter_the_cache_only_when_asked(tiny, tokenizer, cache_requests):
    cache = SuffixCache(max_tokens=4096)
    cache.add([1, 2, 3, 4])  # e.g. a datastore file
    settings = ServerSettings(model_name=NAME, cache_requests=cache_requests)
    with _serving(create_app(tiny, tokenizer, settings, cache)) as url:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 4}, timeout=60)
    assert response.status_code == 200
    assert cache.n_documents == (2 if cache_requests else 1)


def test_default_model_serves_with_its_draft_head(default_model):
    """`lookahead serve --draft-head auto`: the shipped head drafts the requests (its drafts accepted) and the text is
    mode off's."""
    model, tokenizer = default_model
    content = "Write a short story about a robot who learns to paint."
    expected = _reference(model, tokenizer, _chat_text(tokenizer, content), 40)
    settings = ServerSettings(model_name="d", config=LookaheadConfig(draft_head="auto"))
    with _serving(create_app(model, tokenizer, settings, None)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        response = client.chat.completions.create(model="d", max_tokens=40,
                                                  messages=[{"role": "user", "content": content}])
    assert response.choices[0].message.content == expected
    assert response.model_extra["lookahead"]["accepted_by_drafter"].get("head", 0) > 0
