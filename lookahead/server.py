"""`lookahead serve`: an OpenAI-compatible completion server (Starlette + uvicorn) for code-completion clients.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (chat template applied), `GET /v1/models`,
`GET /health`. `temperature` defaults to 0 (greedy: every response is token-identical to
`lookahead generate --mode off` for the same prompt); `temperature > 0` samples exactly from the model's
distribution, and with `seed` the same request gives the same tokens. Responses carry the speculation stats in an extra
`lookahead` field (tokens per step, ...).

Concurrency: the model is not thread-safe, so one worker thread runs the generations one at a time, in arrival
order (at most `max_queue` waiting behind the running one, then 503). Tokens reach the request's coroutine
through an asyncio queue as soon as a step commits them; a client that disconnects sets its job's cancel flag,
which a stopping criterion checks after every committed token; shutting down (Ctrl-C) sets every job's flag.
After each generation, prompt + output go into the `SuffixCache`, which drafts for later requests (editors
re-send almost the same file on every keystroke).

Who may send requests (Host, Origin, API key, content type) is `server_guard`'s job; connection limits,
timeouts and the prompt shutdown are `server_http`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .config import LookaheadConfig
from .hf import Lookahead
from .recycle import RecycleTable
from .server_guard import LOOPBACK_HOSTS, RequestGuard, check_origin
from .server_schema import (APIError, ChatRequest, Completion, CompletionRequest, ResponseShape, Sampling,
                            parse_body, sampling, speculation_stats, sse, stop_strings)
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
    client has to send a complete request after connecting or after the previous response.
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


def model_name_for(path: str | None) -> str:
    """The served model name for a `--model` path: the folder name or the .gguf file's stem; for None, the
    default model's name."""
    if path is None:
        return DEFAULT_MODEL_NAME
    resolved = Path(path).expanduser().resolve()
    return resolved.stem if resolved.suffix == ".gguf" else resolved.name


def sampling_kwargs(params: Sampling) -> dict:
    """`generate()` keyword arguments choosing tokens as `params` asks: temperature 0 is greedy, otherwise exact
    sampling with `temperature` and `top_p` (no top-k, as in OpenAI's API). The seed goes to the decoder config
    (see `_generate`)."""
    if params.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}


# -- completion text: stop strings and safe streaming --------------------------------------------------------

def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index in `text` where the earliest occurrence of any stop string starts, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def stable_length(text: str, stops: tuple[str, ...]) -> int:
    """How much of a growing completion `text` can be sent now: never a stop string nor what follows it, nor a
    tail that may still become a stop string, nor a trailing incomplete UTF-8 character (decoded as U+FFFD)."""
    cut = first_stop(text, stops)
    if cut is not None:
        return cut
    end = len(text.rstrip("\ufffd"))
    hold = max((k for s in stops for k in range(1, min(len(s), end + 1)) if text[:end].endswith(s[:k])),
               default=0)
    return end - hold


class _TextStreamer(BaseStreamer):
    """Receives committed token chunks from the decoder and emits ("delta", text) events of stable text."""

    def __init__(self, decode, stops: tuple[str, ...], emit):
        self.decode, self.stops, self.emit = decode, stops, emit
        self.ids: list[int] = []
        self.sent = 0
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        """Take the next committed tokens ([n] or [1, n]); the first call carries the prompt and is skipped."""
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids += value.reshape(-1).tolist()
        text = self.decode(self.ids)
        stable = stable_length(text, self.stops)
        if stable > self.sent:
            self.emit(("delta", text[self.sent: stable]))
            self.sent = stable

    def end(self) -> None:
        """Nothing to flush: the final text travels with the "done" event."""


class _Cancelled(StoppingCriteria):
    """Stops the generation once `event` is set (the client went away, or the server is shutting down)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class _StopText(StoppingCriteria):
    """Stops once the completion text contains a stop string (checked on the last few tokens' text).

    transformers' `StopStringCriteria` preprocesses the whole vocabulary per request (~1.5 s here); decoding
    the tail is enough because the decoder checks after every committed token, so a stop string is caught in
    the token that completes it. A tail of `4 * len(stop) + 4` tokens covers the string even if every
    character spans four byte-level tokens.
    """

    def __init__(self, decode, stops: tuple[str, ...], prompt_len: int):
        self.decode, self.stops, self.prompt_len = decode, stops, prompt_len
        self.window = 4 * max(len(s) for s in stops) + 4

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        start = max(self.prompt_len, input_ids.shape[1] - self.window)
        text = self.decode(input_ids[0, start:].tolist())
        return torch.full((input_ids.shape[0],), first_stop(text, self.stops) is not None, dtype=torch.bool)


# -- the generation worker -----------------------------------------------------------------------------------

@dataclass(eq=False)  # identity semantics: jobs live in a set
class _Job:
    """One generation: prompt ids [1, L], the token budget, stop strings, sampling, cancel flag, event sink."""

    input_ids: torch.Tensor
    max_new_tokens: int
    stops: tuple[str, ...]
    sampling: Sampling
    cancel: threading.Event
    emit: object  # callable(event): thread-safe, delivers to the request's coroutine


class JobStream:
    """The asynchronous side of one job: iterate `events()`, call `cancel()` when the client is gone."""

    def __init__(self, cancel: threading.Event):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancel = cancel

    def emit(self, event: tuple) -> None:
        """Deliver an event from the worker thread (dropped if the event loop is already closed)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def events(self):
        """Yield ("delta", str) events, then ("done", Completion); re-raise a worker failure."""
        while True:
            kind, payload = await self._queue.get()
            if kind == "error":
                raise payload
            yield kind, payload
            if kind == "done":
                return

    def cancel(self) -> None:
        """Ask the worker to stop this job (no-op once it is done)."""
        self._cancel.set()


class Engine:
    """Owns the model, the tokenizer (behind a lock: it is shared by the event loop and the worker) and the
    single generation worker thread."""

    def __init__(self, model, tokenizer, config: LookaheadConfig, cache: SuffixCache | None, max_queue: int):
        self.model, self.tokenizer, self.config, self.cache = model, tokenizer, config, cache
        # Token recycling learns the model's own next-token predictions: kept across requests, like the cache.
        self.recycle_table = RecycleTable(config.recycle_k) if config.recycle_nodes else None
        self.max_queue = max_queue
        eos = model.generation_config.eos_token_id
        self.eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        self._tokenizer_lock = threading.Lock()
        self._lock = threading.Lock()
        self._jobs: set[_Job] = set()  # submitted and not finished
        self._closing = False  # set by `cancel_all`: new jobs are refused
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lookahead-generate")
        self.last_completion: Completion | None = None  # the latest finished job (reported by /health)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (the same call as `lookahead generate`)."""
        with self._tokenizer_lock:
            return self.tokenizer(text).input_ids

    def chat_text(self, messages: list[dict]) -> str:
        """The chat template applied to `messages` with the generation prompt; `APIError` without a template."""
        if not self.tokenizer.chat_template:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           param="messages")
        with self._tokenizer_lock:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def decode(self, ids: list[int]) -> str:
        """Text of completion token ids, special tokens (EOS) left out."""
        with self._tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def queued(self) -> int:
        """Jobs submitted and not finished (the running one included)."""
        return len(self._jobs)

    def start(self, input_ids: list[int], max_new_tokens: int, stops: tuple[str, ...],
              params: Sampling) -> JobStream:
        """Queue a generation; returns its `JobStream` (call from the event loop).

        Raises `APIError` (503) when `max_queue` jobs are already waiting behind the running one, or when the
        server is shutting down.
        """
        cancel = threading.Event()
        stream = JobStream(cancel)
        job = _Job(torch.tensor([input_ids], dtype=torch.long), max_new_tokens, stops, params, cancel, stream.emit)
        with self._lock:
            if self._closing:
                raise shutting_down()
            if len(self._jobs) > self.max_queue:  # one of them is running
                raise APIError(503, f"server busy: {len(self._jobs) - 1} generations waiting; retry later",
                               type="server_error", code="server_busy", headers=RETRY_AFTER)
            self._jobs.add(job)
        self._executor.submit(self._run, job)
        return stream

    def cancel_all(self) -> None:
        """Refuse new jobs and cancel every submitted one (each running job ends within one step)."""
        with self._lock:
            self._closing = True
            for job in self._jobs:
                job.cancel.set()

    @property
    def closing(self) -> bool:
        """Whether `cancel_all` was called (the server is shutting down)."""
        return self._closing

    def close(self) -> None:
        """Cancel every job and wait for the worker to drain."""
        self.cancel_all()
        self._executor.shutdown(wait=True)

    def _run(self, job: _Job) -> None:
        """Worker: generate (unless cancelled meanwhile) and report "done" or "error" to the job's stream."""
        try:
            prompt_len = job.input_ids.shape[1]
            completion = Completion("", "cancelled", prompt_len, 0, {}) if job.cancel.is_set() \
                else self._generate(job)
            self.last_completion = completion
            job.emit(("done", completion))
        except Exception as exc:  # reported to its client; the worker keeps serving the others
            log.exception("generation failed")
            job.emit(("error", exc))
        finally:
            with self._lock:
                self._jobs.discard(job)

    def _generate(self, job: _Job) -> Completion:
        """Run `model.generate` with lookahead for one job; feed the suffix cache; return the `Completion`."""
        prompt_len = job.input_ids.shape[1]
        criteria = StoppingCriteriaList([_Cancelled(job.cancel)])
        if job.stops:
            criteria.append(_StopText(self.decode, job.stops, prompt_len))
        config = self.config if job.sampling.seed is None else self.config.with_overrides(seed=job.sampling.seed)
        decoder = Lookahead(config, shared_drafter=self.cache, recycle_table=self.recycle_table)
        output = self.model.generate(
            job.input_ids, attention_mask=torch.ones_like(job.input_ids), max_new_tokens=job.max_new_tokens,
            stopping_criteria=criteria, custom_generate=decoder,
            lookahead_streamer=_TextStreamer(self.decode, job.stops, job.emit), **sampling_kwargs(job.sampling))
        new = output[0, prompt_len:].tolist()
        if self.cache is not None:
            self.cache.add(output[0].cpu().numpy())
        text = self.decode(new)
        cut = first_stop(text, job.stops)
        if job.cancel.is_set():
            reason = "cancelled"
        elif cut is not None or (new and new[-1] in self.eos_ids) or len(new) < job.max_new_tokens:
            reason = "stop"
        else:
            reason = "length"
        return Completion(text if cut is None else text[:cut], reason, prompt_len, len(new),
                          speculation_stats(decoder.last_stats))


# -- HTTP ----------------------------------------------------------------------------------------------------

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
        """`GET /health`: status, model, queued generations, suffix cache occupancy, the latest generation."""
        cache = self.engine.cache.info() if self.engine.cache is not None else None
        last = self.engine.last_completion
        latest = None if last is None else {"finish_reason": last.finish_reason, "prompt_tokens": last.prompt_tokens,
                                            "completion_tokens": last.completion_tokens, "lookahead": last.stats}
        return JSONResponse({"status": "ok", "model": self.settings.model_name, "queued": self.engine.queued,
                             "suffix_cache": cache, "latest": latest})

    async def models(self, request: Request) -> JSONResponse:
        """`GET /v1/models`: the one served model."""
        return JSONResponse({"object": "list", "data": [
            {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "lookahead"}]})

    async def completions(self, request: Request):
        """`POST /v1/completions`."""
        body = parse_body(await request.body(), CompletionRequest)
        self._check_model(body.model)
        ids = self._prompt_ids(body.prompt)
        return await self._respond(request, body, ids, body.max_tokens, chat=False, prompt_field="prompt")

    async def chat(self, request: Request):
        """`POST /v1/chat/completions` (the chat template is applied to `messages`)."""
        body = parse_body(await request.body(), ChatRequest)
        self._check_model(body.model)
        text = self.engine.chat_text([{"role": m.role, "content": m.text()} for m in body.messages])
        ids = self.engine.encode(text)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await self._respond(request, body, ids, requested, chat=True, prompt_field="messages")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise APIError(400, f"model {model!r} is not served here; this server serves "
                                f"{self.settings.model_name!r} (see /v1/models)", param="model",
                           code="model_not_found")

    def _prompt_ids(self, prompt: str | list) -> list[int]:
        """Token ids of a completion prompt (a string, a list of one string, or token ids)."""
        if isinstance(prompt, str):
            ids = self.engine.encode(prompt)
        elif prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: batches are not supported (got {len(prompt)} prompts); send one",
                               param="prompt")
            ids = self.engine.encode(prompt[0])
        else:
            vocab = self.engine.model.config.get_text_config().vocab_size
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
                       prompt_field: str):
        params = sampling(body)
        budget = self._budget(len(ids), requested, chat, prompt_field)
        stream = self.engine.start(ids, budget, stop_strings(body), params)
        shape = ResponseShape(chat, self.settings.model_name)
        if body.stream:
            return StreamingResponse(_sse_events(stream, shape, self.engine), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
                                     background=BackgroundTask(stream.cancel))
        completion = await _collect(stream, request)
        if completion.finish_reason == "cancelled":  # by shutdown (a client that left gets no answer anyway)
            raise shutting_down()
        return JSONResponse(shape.whole(completion))


def shutting_down() -> APIError:
    """The 503 answered while the server shuts down."""
    return APIError(503, "server is shutting down; the generation was cancelled", type="server_error",
                    code="server_shutting_down", headers=RETRY_AFTER)


async def _collect(stream: JobStream, request: Request) -> Completion:
    """Wait for the job's completion, cancelling it if the client disconnects (or this task is cancelled)."""
    async def watch_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        stream.cancel()

    watcher = asyncio.create_task(watch_disconnect())
    try:
        async for kind, payload in stream.events():
            if kind == "done":
                return payload
    finally:
        watcher.cancel()
        stream.cancel()  # no-op once done
    raise RuntimeError("generation ended without a result")  # events() always ends with "done" or raises


async def _sse_events(stream: JobStream, shape: ResponseShape, engine: Engine):
    """Server-sent events of one streamed response: chunks as tokens commit, the final chunk, `[DONE]`; a
    generation cancelled by shutdown ends with an in-band error instead (the status line is already sent)."""
    sent = ""
    try:
        if shape.chat:
            yield sse(shape.chunk("", first=True))
        async for kind, payload in stream.events():
            if kind == "delta":
                sent += payload
                yield sse(shape.chunk(payload))
            elif payload.finish_reason == "cancelled" and engine.closing:
                yield sse(shutting_down().body())
                return
            else:
                rest = payload.text[len(sent):] if payload.text.startswith(sent) else ""
                yield sse(shape.last_chunk(payload, rest))
        yield sse("[DONE]")
    except Exception as exc:  # the status line is already sent: report in-band, as OpenAI does
        log.exception("streamed generation failed")
        yield sse(APIError(500, f"generation failed: {exc}", type="server_error").body())
    finally:
        stream.cancel()


def _error_response(request: Request, exc: Exception) -> JSONResponse:
    """Any exception as an OpenAI-style JSON error (`APIError`, routing errors, or a 500)."""
    if isinstance(exc, APIError):
        error = exc
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
    engine = Engine(model, tokenizer, settings.config, cache, settings.max_queue)
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
        exception_handlers={Exception: _error_response, HTTPException: _error_response, APIError: _error_response},
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
