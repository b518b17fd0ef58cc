"""Running the server with uvicorn: bounded connections, a deadline for every request, a prompt shutdown.

uvicorn's h11 protocol closes a keep-alive connection after `timeout_keep_alive` idle seconds once a response
is sent, but a fresh connection, slow headers or a slow body (bytes trickling in) can hold a socket forever.
`BoundedH11` adds one deadline: a client has `request_timeout` seconds from connecting (or from the previous
response) to deliver a complete request, headers and body; the connection is closed otherwise. Headers are
also capped at h11's 16 KiB and bodies by the app's `--max-body-bytes`. Beyond `max_connections` open
connections a new one gets a bare 503 and is closed.

On Ctrl-C, uvicorn stops accepting connections and waits for open responses to finish, which for a
generation can take minutes; `_Server` first cancels every generation (each ends within one decoding step),
so the waiting clients get a 503 (or, when streaming, an in-band error) and the process exits in about a
second.
"""

from __future__ import annotations

import asyncio
import json
import socket

import h11
import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol

from .server_bind import check_bind
from .server_schema import APIError

KEEP_ALIVE_SECONDS = 5  # idle keep-alive connections close after this (uvicorn's default)
GRACE_SECONDS = 3  # after cancelling the generations, how long shutdown waits for responses to finish
_WAITING = (h11.IDLE, h11.SEND_BODY)  # the client's states while its request is incomplete


def _refusal(max_connections: int) -> bytes:
    """A complete HTTP/1.1 503 response (JSON error, `Retry-After`) for a connection over the cap."""
    body = json.dumps(APIError(503, f"too many open connections (at most {max_connections}); retry later",
                               type="server_error", code="too_many_connections").body()).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
            "\r\nretry-after: 1\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class BoundedH11(H11Protocol):
    """uvicorn's h11 connection with a connection cap and a complete-request deadline (see the module docstring).

    Subclass it with the class attributes set (`make_server` does).
    """

    max_connections: int = 64
    request_timeout: float = 10.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        """Register the connection; refuse it over the cap, else start the deadline for its first request."""
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(_refusal(self.max_connections))
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        """Feed h11; once the request is complete, the deadline is off (the app may take its time)."""
        super().data_received(data)
        if self.conn.their_state not in _WAITING:
            self._disarm()

    def on_response_complete(self) -> None:
        """After a response, the next request (or the rest of an unread body) gets a fresh deadline."""
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state in _WAITING:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        """Drop the deadline, then let uvicorn clean up."""
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        # Closing is enough: uvicorn then reports a disconnect to an app still reading the body.
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server that cancels every generation as soon as shutdown starts."""

    def __init__(self, config: uvicorn.Config, engine):
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None) -> None:
        """Cancel the generations (new ones get 503), then shut down as uvicorn does."""
        self.engine.cancel_all()
        await super().shutdown(sockets=sockets)


def make_server(app: Starlette, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for `create_app`'s `app` with its settings' connection cap and request deadline.

    Raises `ValueError` for a non-loopback `host` without an API key. Run it with `.run()` (or
    `.run(sockets=[...])`); Ctrl-C cancels the generations and exits.
    """
    settings = app.state.settings
    check_bind(host, settings.api_key)
    protocol = type("BoundedH11", (BoundedH11,), {"max_connections": settings.max_connections,
                                                  "request_timeout": settings.request_timeout})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, ws="none",
                            lifespan="on", timeout_keep_alive=KEEP_ALIVE_SECONDS,
                            timeout_graceful_shutdown=GRACE_SECONDS)
    return _Server(config, app.state.engine)


def run_server(app: Starlette, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               sock: socket.socket | None = None) -> None:
    """Serve `app` until interrupted (Ctrl-C); see `make_server`. `sock`: a socket already bound to host:port
    (`listening_socket`), served instead of binding a new one."""
    make_server(app, host, port, log_level).run(sockets=None if sock is None else [sock])


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (port 0: a free port, read it with `getsockname()`), for `run_server`;
    binding before the model loads makes a busy port fail at once. Raises `ValueError` saying why it cannot bind
    (uvicorn's own `Config.bind_socket` logs and exits the process instead)."""
    address = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart reuses the port at once
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock
