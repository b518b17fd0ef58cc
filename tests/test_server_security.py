"""`lookahead serve` against hostile input and web pages, over real HTTP on loopback (see `lookahead.server_guard`,
`lookahead.server_http`): body validation, Host/Origin/API-key/content-type checks, connection limits and
timeouts, Ctrl-C during a generation, and a property test that no body makes the server answer 5xx.

The served model is a tiny random Llama with the default model's real tokenizer (no model download).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import one_thread, serving  # noqa: F401  (one_thread: autouse fixture)
from tiny_models import build_tiny_model
from transformers import AutoTokenizer

from lookahead.cli.main import main
from lookahead.models import default_model_folder
from lookahead.server import ServerSettings, create_app
from lookahead.server_bind import allowed_hosts_for, check_bind
from lookahead.server_guard import host_name

NAME = "tiny"
CONTEXT = 128
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_folder())


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return build_tiny_model(vocab=len(tokenizer), dtype=torch.float32)


def _app(tiny, tokenizer, **overrides):
    return create_app(tiny, tokenizer, ServerSettings(model_name=NAME, context_length=CONTEXT, **overrides))


@pytest.fixture(scope="module")
def url(tiny, tokenizer):
    """A server with the default access rules (loopback Host, no allowed origin, no key)."""
    with serving(_app(tiny, tokenizer)) as base:
        yield base


def _error(response: httpx.Response) -> dict:
    assert response.headers["content-type"] == "application/json", response.text
    return response.json()["error"]


# -- bodies that are JSON but not a valid request --------------------------------------------------------------

_DEEP = b'{"prompt": "x", "stream_options": ' + b'{"a": ' * 40 + b"1" + b"}" * 41
_HUGE_INT = b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "seed": -3}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70, "stream": True}, "seed"),  # 400, not an in-band error
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": -1, "stream": True}, "seed"),
    ("/v1/completions", {"prompt": "caf\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": ["\udfff"]}, "prompt[0]"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, "stop[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
     "messages[0].content[0].text"),
    ("/v1/completions", _DEEP, None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None),  # too deep for the JSON parser itself
    ("/v1/completions", _HUGE_INT, None),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e-300}, "temperature"),  # logits / T overflow
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', None),
    ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', None),
])
def test_bad_bodies_get_400_naming_the_field(url, path, body, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ensure_ascii: "\ud800" stays escaped
    response = httpx.post(f"{url}{path}", content=raw, headers=JSON)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] == param and error["type"] == "invalid_request_error"


# -- Host, Origin, content type, API key --------------------------------------------------------------------

def test_host_names_this_server_or_400(url):
    port = url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}"):
        assert httpx.get(f"{url}/health", headers={"host": host}).status_code == 200, host
    for host in (f"attacker.example:{port}", "127.0.0.1.attacker.example", "0.0.0.0", ""):
        response = httpx.get(f"{url}/health", headers={"host": host})
        assert response.status_code == 400 and _error(response)["code"] == "host_not_allowed", host
    assert host_name("[::1]:8000") == "::1" and host_name("LocalHost.:80") == "localhost"


def test_no_host_header_is_refused(url):
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")  # HTTP/1.0 allows leaving Host out
        answer = b""
        while chunk := sock.recv(4096):  # headers and body may arrive apart; the server closes after the body
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400") and b"missing Host header" in answer


def test_web_pages_cannot_post(url):
    """What a page can send without a preflight (text/plain, form types) and any other origin are refused."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        page = httpx.post(f"{url}/v1/completions", content=body,
                          headers={"content-type": kind, "origin": "https://evil.example"})
        assert page.status_code == 403 and _error(page)["code"] == "origin_not_allowed"
        no_origin = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": kind})
        assert no_origin.status_code == 415 and _error(no_origin)["code"] == "unsupported_media_type"
    assert httpx.post(f"{url}/v1/completions", content=body).status_code == 415  # no content type at all
    for origin in ("https://evil.example", "null", "http://127.0.0.1:1"):
        response = httpx.get(f"{url}/v1/models", headers={"origin": origin})
        assert response.status_code == 403 and "access-control-allow-origin" not in response.headers
    preflight = httpx.options(f"{url}/v1/completions", headers={"origin": "https://evil.example",
                                                                 "access-control-request-method": "POST"})
    assert preflight.status_code == 403
    ok = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_allow_origin_enables_cors_for_that_origin_only(tiny, tokenizer):
    page = "http://localhost:3000"
    with serving(_app(tiny, tokenizer, allow_origins=(page,))) as base:
        preflight = httpx.options(f"{base}/v1/completions", headers={
            "origin": page, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == page
        response = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                              headers={"origin": page})
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == page
        other = httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}, headers={"origin": "http://localhost:3001"})
        assert other.status_code == 403


def test_api_key_is_required_as_a_bearer_token(tiny, tokenizer):
    with serving(_app(tiny, tokenizer, api_key="s3cret")) as base:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                        {"authorization": "Basic s3cret"}):
            response = httpx.get(f"{base}/v1/models", headers=headers)
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
            assert _error(response)["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert good.completions.create(model=NAME, prompt="hi", max_tokens=3).usage.completion_tokens == 3
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="guess", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_non_loopback_bind_needs_an_api_key():
    with pytest.raises(ValueError, match="--api-key"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "key")
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    assert allowed_hosts_for("127.0.0.1") == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts_for("0.0.0.0") == ("*",)  # any name reaches it; the key protects it
    assert "s3cret" not in repr(ServerSettings(api_key="s3cret"))


@pytest.mark.parametrize("args, message", [
    (["--host", "0.0.0.0"], "set --api-key"),
    (["--host", "192.168.1.5", "--api-key", " "], "api_key must be a non-empty string"),
    (["--allow-origin", "localhost:3000"], "--allow-origin takes an origin such as http://localhost:3000"),
    (["--allow-origin", "http://localhost:3000/app"], "--allow-origin takes an origin"),
    (["--request-timeout", "0"], "request-timeout"),
    (["--max-connections", "0"], "max-connections"),
])
def test_serve_refuses_unsafe_or_bad_options_before_loading(args, message):
    result = CliRunner().invoke(main, ["serve", "--model", "/no/such/model", *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_serve_on_a_busy_port_fails_before_the_model_loads(monkeypatch):
    import socket

    import lookahead.models

    def loads(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(lookahead.models, "load_model", loads)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", "--port", str(port)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"Error: cannot listen on 127.0.0.1:{port}: " in result.output


def test_listening_socket_binds_a_free_port_for_port_zero():
    from lookahead.server_http import listening_socket

    with listening_socket("127.0.0.1", 0) as sock:
        assert sock.getsockname()[0] == "127.0.0.1" and sock.getsockname()[1] > 0
    with pytest.raises(ValueError, match="cannot listen on 203.0.113.9:80"):  # not this machine's address
        listening_socket("203.0.113.9", 80)


def test_serve_help_tells_the_truth():
    text = " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split())  # click re-wraps lines
    assert "temperature > 0 are refused" not in text and "exact sampling with temperature > 0" in text
    assert "--api-key" in text and "--allow-origin" in text and "behind the running one" in text


# -- connections: cap and deadlines ----------------------------------------------------------------------------

def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float:
    """Seconds until the server closes `sock` (sending `trickle` one byte every 0.2 s meanwhile); fails after
    `seconds`."""
    start = time.monotonic()
    sock.settimeout(0.2)
    sent = 0
    while time.monotonic() - start < seconds:
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent: sent + 1])
            except OSError:  # closed by the server
                return time.monotonic() - start
            sent += 1
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    raise AssertionError(f"connection still open after {seconds} s")


def test_idle_slow_header_and_slow_body_connections_are_closed(tiny, tokenizer):
    with serving(_app(tiny, tokenizer, request_timeout=1.0)) as base:
        port = int(base.rsplit(":", 1)[1])
        head = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        cases = {"idle": b"", "slow header": head + b"x-pad: " + b"a" * 200,
                 "slow body": head + b"content-length: 1000\r\n\r\n" + b" " * 200}
        for case, trickle in cases.items():
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                # bytes keep arriving every 0.2 s: only a whole-request deadline closes these
                assert _closed_within(sock, 10, trickle) < 10, case
        # a quick client on a keep-alive connection is not affected
        with httpx.Client(base_url=base) as client:
            assert [client.get("/health").status_code for _ in range(3)] == [200, 200, 200]


def test_connections_over_the_cap_get_503(tiny, tokenizer):
    with serving(_app(tiny, tokenizer, max_connections=2)) as base:
        port = int(base.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        time.sleep(0.2)  # let the server register them
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer
        assert b"too_many_connections" in answer
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 10
        while True:  # the slots free up once the server sees the closes
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)


# -- Ctrl-C during generations -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_context_folder(tokenizer, tmp_path_factory):
    """A tiny model folder whose context (100k) lets a chat without max_tokens run for minutes."""
    folder = tmp_path_factory.mktemp("long-context")
    build_tiny_model(vocab=len(tokenizer), dtype=torch.float32, max_position_embeddings=100_000).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ctrl_c_cancels_running_generations_and_exits_promptly(long_context_folder, tmp_path):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w+")
    server = subprocess.Popen([sys.executable, "-m", "lookahead.cli.main", "serve", "--model", str(long_context_folder),
                               "--port", str(port), "--threads", "1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_until_up(server, base, log)
        chat = {"messages": [{"role": "user", "content": "Tell me a long story."}]}  # no max_tokens: ~100k tokens
        results = {}

        def waiting_client():  # queued behind the streamed one
            results["waiting"] = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=120)

        with httpx.stream("POST", f"{base}/v1/chat/completions", json=chat | {"stream": True}, timeout=120) as stream:
            lines = stream.iter_lines()
            events = (line for line in lines if line.startswith("data:"))
            next(events), next(events), next(events)  # the role chunk, then tokens: the generation is running
            thread = threading.Thread(target=waiting_client)
            thread.start()
            time.sleep(0.5)
            start = time.monotonic()
            server.send_signal(signal.SIGINT)
            rest = list(lines)  # the stream ends (with an in-band error) instead of running on
            server.wait(timeout=60)
            elapsed = time.monotonic() - start  # includes the interpreter's own exit (torch: ~1 s)
        thread.join(timeout=30)
        log.seek(0)
        output = log.read()
        assert elapsed < 10, f"shutdown took {elapsed:.1f} s"
        assert server.returncode == 0 and "lookahead serve: stopped" in output and "Traceback" not in output
        assert "server_shutting_down" in "".join(rest) and "data: [DONE]" not in rest
        assert results["waiting"].status_code == 503
        assert results["waiting"].json()["error"]["code"] == "server_shutting_down"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()


def _wait_until_up(server: subprocess.Popen, base: str, log) -> None:
    """Poll `base`/health until the server answers; fail with its log if it exits or takes over 180 s."""
    deadline = time.monotonic() + 180
    while True:
        if server.poll() is not None:
            log.seek(0)
            pytest.fail(f"server exited: {log.read()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


# -- property: no body makes the server answer 5xx -------------------------------------------------------------

_CHARS = st.characters() | st.characters(categories=["Cs"])  # lone surrogates too
_TEXT = st.text(st.characters(), min_size=1, max_size=12)
_WILD_TEXT = st.text(_CHARS, max_size=12)
_ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | _WILD_TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_WILD_TEXT, inner, max_size=3),
                    max_leaves=8)
_MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant"]),
    "content": _TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), min_size=1,
                                max_size=2)})
_PROMPT_FIELD = {
    "/v1/completions": ("prompt", _TEXT | st.lists(st.integers(0, 49_151), max_size=5) | st.lists(_TEXT, max_size=1)),
    "/v1/chat/completions": ("messages", st.lists(_MESSAGE, min_size=1, max_size=3)),
}
_VALID = {  # values the server accepts (or rejects for a reason, e.g. a prompt over the context)
    "model": st.just(NAME), "max_tokens": st.integers(1, 12), "max_completion_tokens": st.integers(1, 12),
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1, exclude_min=True), "seed": st.integers(0, 2**63 - 1),
    "stop": _TEXT | st.lists(_TEXT, max_size=3), "stream": st.booleans(), "user": _TEXT,
    "stream_options": st.just({"include_usage": True}), "n": st.just(1), "presence_penalty": st.just(0),
}
_OTHER_FIELDS = ["prompt", "messages", "logprobs", "echo", "suffix", "best_of", "tools", "response_format",
                 "logit_bias", "frequency_penalty", "top_logprobs"]


@st.composite
def _requests(draw) -> tuple[str, object]:
    """(path, body): a valid request, maybe with one field replaced by any JSON value, or any JSON value."""
    path = draw(st.sampled_from(sorted(_PROMPT_FIELD)))
    kind = draw(st.sampled_from(["valid", "one field off", "anything"]))
    if kind == "anything":
        return path, draw(_ANY | st.dictionaries(st.sampled_from([*_VALID, *_OTHER_FIELDS]), _ANY))
    name, prompt = _PROMPT_FIELD[path]
    body = draw(st.fixed_dictionaries({name: prompt}, optional=_VALID))
    if kind == "one field off":
        body[draw(st.sampled_from([*_VALID, *_OTHER_FIELDS]))] = draw(_ANY)
    return path, body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=_requests())
def test_no_json_body_gets_a_5xx(url, request):
    path, body = request
    raw = json.dumps(body).encode()  # NaN and Infinity included (Python writes them; they must get a 400)
    with httpx.stream("POST", f"{url}{path}", content=raw, headers=JSON, timeout=120) as response:
        text = response.read().decode()
    assert response.status_code < 500, (body, text)
    if response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"):
        assert text.endswith("data: [DONE]\n\n"), (body, text[-300:])


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=64) | st.text(_CHARS, max_size=64).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_no_raw_body_gets_a_5xx(url, raw):
    response = httpx.post(f"{url}/v1/completions", content=raw, headers=JSON)
    assert response.status_code < 500, (raw, response.text)
