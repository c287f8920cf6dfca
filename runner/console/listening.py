"""Where the console and API server listen: the defaults, a socket bound before the server
starts, and a bind that fails read as the flag a person must change.

Its own module, apart from the server, so `runfleet console --help` and `runfleet up` can name
the defaults and bind their port without importing the server (ADR-0024).
"""

from __future__ import annotations

import errno
import socket
from typing import Any, Literal

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
LISTEN_BACKLOG = 128
"""aiohttp's own default, for a socket bound before the server (`listening_socket`)."""


class BindFailed(Exception):
    """The server cannot listen where it was told. It says which of the two a person must
    change (`culprit`) and why, in their words; the caller knows which flag set it, and turns
    this into a usage error naming that flag (SPEC §10: exit 2, never `internal`)."""

    def __init__(self, host: str, port: int, culprit: Literal["host", "port"], reason: str):
        super().__init__(f"cannot listen on {host}:{port}: {reason}")
        self.host = host
        self.port = port
        self.culprit: Literal["host", "port"] = culprit
        self.reason = reason


_BIND_ERRNOS: dict[int, tuple[Literal["host", "port"], str]] = {
    errno.EADDRINUSE: ("port", "address already in use on {host} (something listens there)"),
    errno.EACCES: ("port", "permission denied (ports below 1024 need privileges)"),
    errno.EADDRNOTAVAIL: ("host", "cannot bind that address (no interface of this machine has it)"),
}


def bind_failure(exc: OSError, host: str, port: int) -> BindFailed:
    """A bind's `OSError` (or a name lookup's `gaierror`), read as the host or the port."""
    if not isinstance(exc, socket.gaierror) and exc.errno in _BIND_ERRNOS:
        culprit, reason = _BIND_ERRNOS[exc.errno]
        return BindFailed(host, port, culprit, reason.format(host=host))
    return BindFailed(host, port, "host", f"cannot bind that address ({exc.strerror or exc})")


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket already listening, for `serve(sock=...)`: `runfleet up` binds its API's port
    before it starts a fleet, so a port in use refuses with nothing started and nothing to
    stop, and no other process can take the port in between. `BindFailed` if it cannot."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise bind_failure(exc, host, port) from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers do
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise bind_failure(exc, host, port) from exc
    return sock


def url_of(address: Any) -> str:
    """`http://host:port` of a listening socket's address (an IPv6 host in brackets)."""
    host, port = str(address[0]), int(address[1])
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
