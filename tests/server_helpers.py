"""Running `lookahead.server` apps for the tests: on a free loopback port, in a thread, as `lookahead serve` does."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

from lookahead.server_http import make_server


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Torch on one thread while a module's server tests run: on a shared 2-core machine two threads can be ~10x
    slower (spin-waiting). Import it into a test module to use it there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def serving(app):
    """Run `app` with `make_server` (the CLI's limits and timeouts) on a free loopback port in a thread; yields
    the base URL; stops the server on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(app, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
