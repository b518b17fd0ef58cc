"""Request validation of the OpenAI-compatible server (`lookahead.server`).

Requests are parsed strictly (no string-to-number coercion); unknown fields are ignored so that newer clients
keep working, but known OpenAI fields lookahead cannot honour (echo, penalties, logit_bias, tools, ...) are
rejected with a 400 naming the field, never silently dropped. Bodies that are JSON but not text (a lone
surrogate such as `"\ud800"`), nest deeper than `MAX_DEPTH`, or hold numbers Python will not parse (NaN,
Infinity, integers over 4300 digits) are 400s as well. Every error is an `APIError`, rendered as OpenAI's
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from .sampling_bounds import MIN_TEMPERATURE
from .server_engine import MAX_SEED, Sampling

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # `n` on /v1/completions (OpenAI allows 128; every sample is a whole generation here)
MAX_LOGPROBS = 5  # OpenAI's limit for /v1/completions' `logprobs`
MAX_DEPTH = 32  # nesting of a request body; OpenAI bodies nest 4 deep (messages[0].content[0].text)


class APIError(Exception):
    """An error answered as OpenAI-style JSON with HTTP `status`; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers  # extra response headers (`retry-after`, `www-authenticate`)

    def body(self) -> dict:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    """Fields shared by both endpoints. `None` everywhere means "not sent" (clients often send nulls)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool | None = None
    stream_options: dict | None = None  # accepted; usage is always sent with the final chunk
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None


class CompletionRequest(_Request):
    """`POST /v1/completions` body: `prompt` is a string, a list of token ids, or a list of one string."""

    prompt: str | list[int] | list[str]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    """One `{"type": "text", "text": ...}` part of a chat message's content."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; `content` is a string or a list of text parts (joined). `developer` is OpenAI's newer
    name for `system` (the chat template gets `system`); an assistant turn may send `"content": null`."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content, info: ValidationInfo):
        role = info.data.get("role")
        if content is None and role != "assistant":
            raise ValueError(f"null is only allowed on assistant messages, not on a {role} message")
        return content

    def template_role(self) -> str:
        """The role as chat templates know it (`developer` → `system`)."""
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        """The message content as one string (empty for a null assistant content)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class ChatRequest(_Request):
    """`POST /v1/chat/completions` body (`max_completion_tokens` is the newer name of `max_tokens`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None


def parse_body(raw: bytes, schema: type[_Request]) -> _Request:
    """Parse and validate a JSON request body into `schema`; raise `APIError` (400) naming the bad field."""
    data = _load_json(raw)
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    _check_tree(data)
    try:
        request = schema.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    _check_common(request)
    return request


def _load_json(raw: bytes):
    """`raw` parsed as JSON; `APIError` (400) for invalid JSON, NaN/Infinity, integers over Python's 4300-digit
    limit and nesting too deep for the parser."""
    def no_constant(name: str):
        raise APIError(400, f"request body is not valid JSON: {name} is not a JSON number")

    try:
        return json.loads(raw, parse_constant=no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, f"request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError:  # int("9" * 5000): Python refuses integers over sys.get_int_max_str_digits() digits
        raise APIError(400, "request body holds an integer with too many digits") from None


def _check_tree(data: dict) -> None:
    """`APIError` (400, naming the path) for a body nested deeper than `MAX_DEPTH` or holding a string (value or
    key) that is not text: JSON can escape a lone UTF-16 surrogate (`"\ud800"`), which no tokenizer can encode.
    Iterative, so no depth can overflow the stack."""
    stack = [("", data, 1)]
    while stack:
        path, value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise APIError(400, f"request body nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, str) and not _is_text(value):
            raise APIError(400, f"{path}: string holds a lone UTF-16 surrogate (not text)", param=path)
        if isinstance(value, dict):
            for key, item in value.items():
                if not _is_text(key):
                    raise APIError(400, "request body has a key holding a lone UTF-16 surrogate (not text)")
                stack.append((f"{path}.{key}" if path else key, item, depth + 1))
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value)]


def _is_text(value: str) -> bool:
    """Whether `value` is encodable text (no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as an `APIError` naming the field path (e.g. `messages[0].role`).

    For a union field pydantic reports one error per alternative, tagged with the alternative's type in the
    location (`("prompt", "list[int]", 1)`); those become one message listing the accepted forms.
    """
    errors = exc.errors()
    loc = errors[0]["loc"]
    path, depth = "", len(loc)
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part[0].islower() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
        else:
            depth = i
            break
    if depth < len(loc):
        forms = dict.fromkeys(str(e["loc"][depth]) for e in errors
                              if e["loc"][:depth] == loc[:depth] and len(e["loc"]) > depth)
        return APIError(400, f"{path}: invalid value; expected one of: {', '.join(forms)}", param=path)
    message = errors[0]["msg"].removeprefix("Value error, ")  # a validator's own sentence, without pydantic's tag
    return APIError(400, f"{path}: {message}" if path else message, param=path or None)


_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict")


def _check_common(request: _Request) -> None:
    """Range checks and fields lookahead cannot honour; raise `APIError` (400) naming the field."""
    if request.max_tokens is not None and request.max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {request.max_tokens}", param="max_tokens")
    temperature = request.temperature
    if temperature is not None and not (temperature == 0 or MIN_TEMPERATURE <= temperature <= 2):
        raise APIError(400, f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, 2], got {temperature}",
                       param="temperature")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {request.top_p}", param="top_p")
    stops = stop_strings(request)
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise APIError(400, f"stop must be at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
    unsupported = {
        "presence_penalty": request.presence_penalty not in (None, 0),
        "frequency_penalty": request.frequency_penalty not in (None, 0),
        "logit_bias": bool(request.logit_bias),
    }
    if isinstance(request, CompletionRequest):
        _check_completion(request)
        unsupported |= {"echo": bool(request.echo)}
    else:
        unsupported |= {"n": request.n not in (None, 1), "logprobs": bool(request.logprobs),
                        "top_logprobs": request.top_logprobs is not None,
                        "tools": bool(request.tools), "response_format": request.response_format is not None}
        if request.max_completion_tokens is not None and request.max_completion_tokens < 1:
            raise APIError(400, f"max_completion_tokens must be >= 1, got {request.max_completion_tokens}",
                           param="max_completion_tokens")
    for name, bad in unsupported.items():
        if bad:
            raise APIError(400, f"{name}={getattr(request, name)!r} is not supported by lookahead serve; "
                                f"omit it or send its default", param=name)


def _check_completion(request: CompletionRequest) -> None:
    """The `/v1/completions` fields beyond the common ones: n, best_of, logprobs, suffix."""
    n = choices(request)
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {n}", param="n")
    if request.best_of not in (None, n):
        raise APIError(400, f"best_of={request.best_of!r} is not supported by lookahead serve: every sample is "
                            f"returned, so best_of must equal n ({n}) or be omitted", param="best_of")
    if request.logprobs is not None:
        if not 0 <= request.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {request.logprobs}", param="logprobs")
        if request.stream:
            raise APIError(400, "logprobs cannot be streamed by lookahead serve; send stream=false with logprobs",
                           param="logprobs")
    if request.suffix and not _is_text_prompt(request.prompt):
        raise APIError(400, "suffix needs a text prompt (the prefix), got token ids", param="suffix")


def _is_text_prompt(prompt: str | list) -> bool:
    """Whether a completion prompt is text (a string or a list of strings) rather than token ids."""
    return isinstance(prompt, str) or all(isinstance(p, str) for p in prompt)


def choices(request: _Request) -> int:
    """How many choices the request asks for (`n`, 1 when omitted)."""
    return 1 if request.n is None else request.n


def stop_strings(request: _Request) -> tuple[str, ...]:
    """The request's stop strings as a tuple (empty when none)."""
    if request.stop is None:
        return ()
    return (request.stop,) if isinstance(request.stop, str) else tuple(request.stop)


def sampling(request: _Request) -> Sampling:
    """The request's sampling settings; omitted temperature means 0 (greedy), omitted top_p means 1."""
    temperature = 0.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    return Sampling(temperature=temperature, top_p=top_p, seed=request.seed)
