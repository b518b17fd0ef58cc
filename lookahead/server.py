"""`lookahead serve`: an OpenAI-compatible completion server (Starlette + uvicorn) for code-completion clients.

Endpoints: `POST /v1/completions` (`suffix`: fill-in-the-middle; `n` samples; `logprobs`),
`POST /v1/chat/completions` (chat template applied), `GET /v1/models`, `GET /health`. `temperature` defaults to
0 (greedy: every response is token-identical to `lookahead generate --mode off` for the same prompt);
`temperature > 0` samples exactly from the model's distribution, and with `seed` the same request gives the same
tokens. Responses carry the speculation stats in an extra `lookahead` field (tokens per step, ...).

This module is the HTTP side: settings, the endpoints, and the mapping of the engine's errors to status codes.
Generations run in `server_engine` (queue, worker thread, cancellation); requests are validated and responses
shaped by `server_schema`; who may send requests (Host, Origin, API key, content type) is `server_guard`'s job;
connection limits, timeouts and the prompt shutdown are `server_http`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .config import LookaheadConfig
from .prompt_cache import PromptCache
from .server_engine import (Completion, Delta, Engine, EngineBusy, EngineClosed, EngineError, JobSpec, JobStream,
                            NoChatTemplate, NoFimTokens)
from .server_bind import LOOPBACK_HOSTS, check_origin
from .server_guard import RequestGuard
from .server_response import ResponseShape, speculation_stats, sse
from .server_schema import APIError, ChatRequest, CompletionRequest, choices, parse_body, sampling, stop_strings
from .suffix_cache import SuffixCache

log = logging.getLogger("lookahead.server")

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
RETRY_AFTER = {"retry-after": "1"}  # seconds, on 503s: the queue moves every generation, shutdown is quick


@dataclass(frozen=True)
class ServerSettings:
    """Server knobs, validated on construction (raises `ValueError` naming the field).

    model_name: the `model` clients send (others get 400); config: the speculation settings of every request;
    context_length: prompt + completion cap in tokens (None: the model's `max_position_embeddings`);
    max_body_bytes: request bodies above this get 413; max_queue: generations waiting (behind the running one)
    beyond this get 503. Access (see `server_guard`): api_key: required as `Authorization: Bearer` (None: no
    key); allowed_hosts: `Host` names served (`allowed_hosts_for(bind)`); allow_origins: browser origins allowed
    cross-origin. Connections (see `server_http`): max_connections open at once; request_timeout: seconds a
    client has to send a complete request after connecting or after the previous response. cache_requests:
    whether requests go into the cross-request cache (False: it only drafts from what it holds, e.g. a datastore).
    prompt_cache_bytes: bound of the prompt cache, the keys and values of the latest texts reused by a request that
    starts the same way as one of them (`prompt_cache`; 0: none).
    """

    model_name: str = DEFAULT_MODEL_NAME
    config: LookaheadConfig = field(default_factory=LookaheadConfig)
    context_length: int | None = None
    max_body_bytes: int = 1 << 20
    max_queue: int = 32
    api_key: str | None = field(default=None, repr=False)  # kept out of logs
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS
    allow_origins: tuple[str, ...] = ()
    max_connections: int = 64
    request_timeout: float = 10.0
    cache_requests: bool = True
    prompt_cache_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must be a non-empty string")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be a non-empty string")
        if not self.allowed_hosts:
            raise ValueError("allowed_hosts must name at least one host")
        for origin in self.allow_origins:
            check_origin(origin)
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be >= 0, got {self.prompt_cache_bytes}")


def model_name_for(path: str | None) -> str:
    """The served model name for a `--model` path: the folder name or the .gguf file's stem; for None, the
    default model's name."""
    if path is None:
        return DEFAULT_MODEL_NAME
    resolved = Path(path).expanduser().resolve()
    return resolved.stem if resolved.suffix == ".gguf" else resolved.name


class BodyLimit:
    """ASGI middleware: answer 413 to request bodies over `max_bytes` (declared or streamed), before the app
    reads them; otherwise hand the app the buffered body, then the client's later messages (disconnects)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        """Answer 413 and close the connection (the rest of the body is not read)."""
        error = APIError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")
        await JSONResponse(error.body(), status_code=413, headers={"connection": "close"})(scope, receive, send)


class _Handlers:
    """The endpoints, bound to one `Engine` and `ServerSettings`."""

    def __init__(self, engine: Engine, settings: ServerSettings, context_length: int):
        self.engine, self.settings, self.context_length = engine, settings, context_length

    async def health(self, request: Request) -> JSONResponse:
        """`GET /health`: status, model, queued generations, suffix and prompt cache occupancy, the latest
        generation."""
        cache = self.engine.cache.info() if self.engine.cache is not None else None
        prompts = self.engine.prompt_cache.info() if self.engine.prompt_cache is not None else None
        last = self.engine.last_completion
        latest = None if last is None else {"finish_reason": last.finish_reason, "prompt_tokens": last.prompt_tokens,
                                            "completion_tokens": last.completion_tokens,
                                            "lookahead": speculation_stats([last.stats])}
        return JSONResponse({"status": "ok", "model": self.settings.model_name, "queued": self.engine.queued,
                             "suffix_cache": cache, "prompt_cache": prompts, "latest": latest})

    async def models(self, request: Request) -> JSONResponse:
        """`GET /v1/models`: the one served model."""
        return JSONResponse({"object": "list", "data": [
            {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "lookahead"}]})

    async def completions(self, request: Request):
        """`POST /v1/completions` (with `suffix`: fill-in-the-middle)."""
        body = parse_body(await request.body(), CompletionRequest)
        self._check_model(body.model)
        ids = self._prompt_ids(body.prompt, body.suffix)
        return await self._respond(request, body, ids, body.max_tokens, chat=False, prompt_field="prompt",
                                   logprobs=body.logprobs)

    async def chat(self, request: Request):
        """`POST /v1/chat/completions` (the chat template is applied to `messages`)."""
        body = parse_body(await request.body(), ChatRequest)
        self._check_model(body.model)
        text = self.engine.chat_text([{"role": m.template_role(), "content": m.text()} for m in body.messages])
        ids = self.engine.encode(text)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await self._respond(request, body, ids, requested, chat=True, prompt_field="messages")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise APIError(404, f"model {model!r} is not served here; this server serves "
                                f"{self.settings.model_name!r} (see /v1/models)", param="model",
                           code="model_not_found")

    def _prompt_ids(self, prompt: str | list, suffix: str | None) -> list[int]:
        """Token ids of a completion prompt (a string, a list of one string, or token ids); with a `suffix`
        (text prompts only, see `server_schema`), of the fill-in-the-middle prompt between them."""
        if isinstance(prompt, str) or (prompt and all(isinstance(p, str) for p in prompt)):
            if not isinstance(prompt, str) and len(prompt) != 1:
                raise APIError(400, f"prompt: batches are not supported (got {len(prompt)} prompts); send one",
                               param="prompt")
            text = prompt if isinstance(prompt, str) else prompt[0]
            ids = self.engine.encode(self.engine.fim_text(text, suffix) if suffix else text)
        else:
            vocab = self.engine.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt: token ids must be in [0, {vocab}), got {bad[0]}", param="prompt")
            ids = list(prompt)
        if not ids:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        return ids

    def _budget(self, n_prompt: int, requested: int | None, chat: bool, prompt_field: str) -> int:
        """New-token budget; `APIError` (400, context_length_exceeded) when it does not fit the context."""
        room = self.context_length - n_prompt
        if room < 1:
            raise APIError(400, f"{prompt_field}: the prompt has {n_prompt} tokens; this model's context is "
                                f"{self.context_length} tokens", param=prompt_field, code="context_length_exceeded")
        if requested is None:
            return room if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
        if requested > room:
            raise APIError(400, f"max_tokens: {n_prompt} prompt tokens + {requested} completion tokens exceed this "
                                f"model's context of {self.context_length} tokens", param="max_tokens",
                           code="context_length_exceeded")
        return requested

    async def _respond(self, request: Request, body, ids: list[int], requested: int | None, chat: bool,
                       prompt_field: str, logprobs: int | None = None):
        """Queue the request's job and answer with its choices, whole or streamed."""
        params = sampling(body)
        n = choices(body)
        copies = 1 if params.temperature > 0 else n  # greedy choices are identical: generate once, answer n times
        spec = JobSpec(ids, self._budget(len(ids), requested, chat, prompt_field), stop_strings(body), params,
                       samples=n // copies, logprobs=logprobs)
        stream = self.engine.start(spec)
        shape = ResponseShape(chat, self.settings.model_name, copies)
        if body.stream:
            return StreamingResponse(_sse_events(stream, shape, self.engine), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
                                     background=BackgroundTask(stream.cancel))
        completions = await _collect(stream, request)
        if any(c.finish_reason == "cancelled" for c in completions):  # by shutdown (a client that left gets none)
            raise api_error(EngineClosed())
        return JSONResponse(shape.whole(completions))


def api_error(exc: EngineError) -> APIError:
    """The HTTP answer to an engine error: 503 with `Retry-After` when busy or shutting down, 400 for a request
    the model cannot serve."""
    if isinstance(exc, EngineBusy):
        return APIError(503, str(exc), type="server_error", code="server_busy", headers=RETRY_AFTER)
    if isinstance(exc, EngineClosed):
        return APIError(503, str(exc), type="server_error", code="server_shutting_down", headers=RETRY_AFTER)
    if isinstance(exc, NoChatTemplate):
        return APIError(400, str(exc), param="messages")
    if isinstance(exc, NoFimTokens):
        return APIError(400, str(exc), param="suffix")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


async def _collect(stream: JobStream, request: Request) -> list[Completion]:
    """Wait for the job's completions, cancelling it if the client disconnects (or this task is cancelled)."""
    async def watch_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        stream.cancel()

    watcher = asyncio.create_task(watch_disconnect())
    try:
        return await stream.completions()
    finally:
        watcher.cancel()
        stream.cancel()  # no-op once done


async def _sse_events(stream: JobStream, shape: ResponseShape, engine: Engine):
    """Server-sent events of one streamed response: chunks as tokens commit, each choice's final chunk (the last
    one with usage), `[DONE]`; a generation cancelled by shutdown ends with an in-band error instead (the status
    line is already sent)."""
    sent: dict[int, str] = {}  # streamed text per engine sample
    finished: list[Completion] = []
    try:
        if shape.chat:
            yield sse(shape.chunk("", first=True))
        async for event in stream.events():
            if isinstance(event, Delta):
                sent[event.index] = sent.get(event.index, "") + event.text
                for index in shape.choices_of(event.index):
                    yield sse(shape.chunk(event.text, index))
            elif event.completion.finish_reason == "cancelled" and engine.closing:
                yield sse(api_error(EngineClosed()).body())
                return
            else:
                done, streamed = event.completion, sent.get(event.index, "")
                finished.append(done)
                rest = done.text[len(streamed):] if done.text.startswith(streamed) else ""
                indices = shape.choices_of(event.index)
                for index in indices:
                    last = len(finished) == stream.samples and index == indices[-1]
                    yield sse(shape.last_chunk(done, rest, index, finished if last else None))
        yield sse("[DONE]")
    except Exception as exc:  # the status line is already sent: report in-band, as OpenAI does
        log.exception("streamed generation failed")
        yield sse(APIError(500, f"generation failed: {exc}", type="server_error").body())
    finally:
        stream.cancel()


def _error_response(request: Request, exc: Exception) -> JSONResponse:
    """Any exception as an OpenAI-style JSON error (`APIError`, engine and routing errors, or a 500)."""
    if isinstance(exc, APIError):
        error = exc
    elif isinstance(exc, EngineError):
        error = api_error(exc)
    elif isinstance(exc, HTTPException):
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    else:
        log.exception("unhandled error", exc_info=exc)
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def create_app(model, tokenizer, settings: ServerSettings | None = None, cache: SuffixCache | None = None) -> Starlette:
    """The ASGI app serving `model` (a transformers causal LM) with `tokenizer`.

    `cache`: the cross-request drafter (None: no cross-request drafts). The app's `state.engine` is the
    `Engine`; it is closed (jobs cancelled, worker joined) when the app shuts down. `state.settings` are the
    settings (`server_http.make_server` reads its connection limits there).
    """
    settings = settings or ServerSettings()
    context = settings.context_length or model.config.get_text_config().max_position_embeddings
    prompt_cache = PromptCache(settings.prompt_cache_bytes) if settings.prompt_cache_bytes else None
    engine = Engine(model, tokenizer, settings.config, cache, settings.max_queue, settings.cache_requests,
                    prompt_cache)
    handlers = _Handlers(engine, settings, context)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.close)

    app = Starlette(
        routes=[Route("/health", handlers.health, methods=["GET"]),
                Route("/v1/models", handlers.models, methods=["GET"]),
                Route("/v1/completions", handlers.completions, methods=["POST"]),
                Route("/v1/chat/completions", handlers.chat, methods=["POST"])],
        middleware=_middleware(settings),
        exception_handlers={Exception: _error_response, HTTPException: _error_response, APIError: _error_response,
                            EngineError: _error_response},
        lifespan=lifespan)
    app.state.engine, app.state.settings = engine, settings
    return app


def _middleware(settings: ServerSettings) -> list[Middleware]:
    """Outermost first: the access checks, CORS for the allowed origins (if any), the body limit."""
    cors = [Middleware(CORSMiddleware, allow_origins=list(settings.allow_origins), allow_methods=["GET", "POST"],
                       allow_headers=["*"])] if settings.allow_origins else []
    return [Middleware(RequestGuard, allowed_hosts=settings.allowed_hosts, allow_origins=settings.allow_origins,
                       api_key=settings.api_key),
            *cors, Middleware(BodyLimit, max_bytes=settings.max_body_bytes)]
