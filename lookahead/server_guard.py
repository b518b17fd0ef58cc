"""Who may drive `lookahead serve`: the checks that keep web pages and other machines out.

A page the user visits in a browser can send requests to `http://127.0.0.1:8000`: a `fetch` with a "simple"
content type (`text/plain`) needs no CORS preflight, and DNS rebinding (a hostile name that first resolves to
the page's server, then to 127.0.0.1) even lets the page read the answers. So every HTTP request must pass,
in this order (`RequestGuard`, an ASGI middleware in front of the app):

1. **Host**: the `Host` header names this server: a loopback name (`localhost`, `127.0.0.1`, `[::1]`) or the
   bound address. A DNS-rebinding page sends its own name and gets 400. A non-loopback bind accepts any Host
   (clients use whatever name reaches the machine) and relies on the API key, which it requires.
2. **Origin**: browsers send `Origin` with every cross-origin request (and every POST); it must be one the
   server was started with (`--allow-origin`), else 403. Non-browser clients send no `Origin`.
3. **API key** (`--api-key`): `Authorization: Bearer <key>`, as the OpenAI clients send it, else 401.
4. **Content type**: a POST must be `application/json` (415 otherwise), which a page cannot send cross-origin
   without a preflight that step 2 refuses.

CORS preflights (`OPTIONS` from an allowed origin) pass steps 3 and 4: browsers send them without credentials,
and Starlette's `CORSMiddleware` answers them.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from .server_bind import ANY_HOST
from .server_schema import APIError

def host_name(header: str) -> str:
    """The host of a `Host` header value, lower-cased, without the port, IPv6 brackets or a trailing dot."""
    name = header.strip().lower()
    if name.startswith("["):
        end = name.find("]")
        return name[1:end] if end > 0 else ""
    return name.partition(":")[0].rstrip(".")


class RequestGuard:
    """ASGI middleware: refuse HTTP requests failing the module's checks with an OpenAI-style JSON error."""

    def __init__(self, app, allowed_hosts: tuple[str, ...], allow_origins: tuple[str, ...], api_key: str | None):
        self.app, self.allowed_hosts, self.allow_origins = app, allowed_hosts, allow_origins
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self.check(Headers(scope=scope), scope["method"])
        if error is None:
            return await self.app(scope, receive, send)
        headers = {"connection": "close", **(error.headers or {})}
        await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)

    def check(self, headers: Headers, method: str) -> APIError | None:
        """The first check the request fails, as an `APIError`, or None."""
        host = headers.get("host")
        if host is None:
            return APIError(400, "missing Host header", code="host_not_allowed")
        if ANY_HOST not in self.allowed_hosts and host_name(host) not in self.allowed_hosts:
            return APIError(400, f"Host {host!r} is not this server (expected one of "
                                 f"{', '.join(self.allowed_hosts)}): refused against DNS rebinding",
                            code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and origin not in self.allow_origins:
            return APIError(403, f"cross-origin request from {origin} refused; start the server with "
                                 f"--allow-origin {origin} to allow that page", code="origin_not_allowed")
        if method == "OPTIONS" and origin is not None:
            return None  # a CORS preflight from an allowed origin: CORSMiddleware answers it
        if self.api_key is not None and not self._authorized(headers.get("authorization", "")):
            return APIError(401, "missing or incorrect API key: send `Authorization: Bearer <key>` with the key "
                                 "the server was started with", code="invalid_api_key",
                            headers={"www-authenticate": "Bearer"})
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if method == "POST" and media_type != "application/json":
            return APIError(415, f"Content-Type must be application/json, got {media_type or 'none'}",
                            code="unsupported_media_type")
        return None

    def _authorized(self, authorization: str) -> bool:
        """Whether the `Authorization` header carries the API key as a Bearer token (constant-time compare)."""
        scheme, _, token = authorization.partition(" ")
        # Starlette decodes header bytes as latin-1: encoding back gives the bytes the client sent.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self.api_key)
