"""Where `lookahead serve` may listen and which names and origins it answers: checks of its command-line
settings, importable before torch and transformers (the command refuses a bad --host or --allow-origin at once);
`server_guard` applies them to every request."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"


def is_loopback(host: str) -> bool:
    """Whether the bind address `host` is `localhost` or a loopback IP address."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(bind: str) -> tuple[str, ...]:
    """Host names requests may address for a server bound to `bind`: the loopback names and `bind` itself for a
    loopback bind; any (`ANY_HOST`) otherwise, where the API key is the protection (see `check_bind`)."""
    if not is_loopback(bind):
        return (ANY_HOST,)
    return tuple(dict.fromkeys((*LOOPBACK_HOSTS, bind.strip("[]").lower())))


def check_bind(bind: str, api_key: str | None) -> None:
    """Raise `ValueError` for a non-loopback bind without an API key (other machines could use the server)."""
    if api_key is None and not is_loopback(bind):
        raise ValueError(f"--host {bind} is reachable from other machines: set --api-key (or $LOOKAHEAD_API_KEY) "
                         "so that only clients holding the key are served")


def check_origin(origin: str) -> str:
    """`origin` if it is a browser origin (`scheme://host[:port]`, no path); `ValueError` otherwise."""
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query or parts.fragment:
        raise ValueError(f"--allow-origin takes an origin such as http://localhost:3000, got {origin!r}")
    return origin
