"""Connecting to NATS, with its errors translated at this boundary (NatsUnavailable).

nats-py applies `max_reconnect_attempts` to the *initial* connect too: with -1 (reconnect
forever, what a long-lived runner wants) an unreachable server would hang every command. So the
first connect gets a few attempts, and only once connected is reconnecting made unbounded.
The client pings every few seconds, so a server that hangs without closing its sockets is given
up within `STALE_AFTER_S` (nats-py's default notices it only after minutes).

`RUNFLEET_NATS_URL` may list a cluster's servers, comma-separated: all of them go to the client,
which connects to one and, when it is lost, reconnects to any other (servers the cluster
advertises are added to that pool as well).
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

from publisher.config import NATS_URL_FILE, UP_LOCK_FILE, NatsSettings
from publisher.errors import NatsUnavailable
from store.url import redact

log = logging.getLogger(__name__)
INITIAL_CONNECT_ATTEMPTS = 3
PING_INTERVAL_S = 5
MAX_OUTSTANDING_PINGS = 3
DRAIN_TIMEOUT_S = 5
"""`nc.drain()`'s bound (nats-py's default is 30 s): a runner drains after every delivery is
disposed of, so only the flush is left; the pod's grace period counts on it."""
STALE_AFTER_S = float(PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1))
"""How long a client stays on a server that hangs (alive, sockets open, answering nothing)
before it gives it up and reconnects to another: at most this many seconds after its last
answered ping. nats-py's default (a ping every 120 s, stale after 2 unanswered) left a runner on
a hung cluster node unable to fetch, ack or publish for four minutes or more while the others
had long elected new leaders (issue 21, `tests/test_nats_hung_server.py`). A ping every 5 s is
a few bytes per connection; a server too busy to answer for 20 s costs a reconnect, not a run."""


async def connect(
    settings: NatsSettings, *, name: str = "runfleet"
) -> tuple[Client, JetStreamContext]:
    # Both read once, before the connect: `up` writes `nats.url` only once its streams take
    # messages, and an error judged on a file written meanwhile would name the wrong server.
    servers = settings.nats_servers()
    no_url = not (settings.data / NATS_URL_FILE).is_file()
    options: dict[str, object] = {
        "servers": servers,
        "name": name,
        "connect_timeout": 2,
        "max_reconnect_attempts": INITIAL_CONNECT_ATTEMPTS,
        "reconnect_time_wait": 0.5,
        "allow_reconnect": True,
        "ping_interval": PING_INTERVAL_S,
        "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
        "drain_timeout": DRAIN_TIMEOUT_S,
        "error_cb": _log_error,
    }
    nc = Client()

    async def closed() -> None:
        # nats-py calls no error callback for a server's `-ERR`: it closes. Say why.
        if nc.last_error is not None:
            log.warning("nats: the connection is closed (last error: %r)", nc.last_error)

    options["closed_cb"] = closed
    if settings.nats_creds is not None:
        options["user_credentials"] = str(settings.nats_creds)
    if settings.nats_tls_ca is not None:
        import ssl

        options["tls"] = ssl.create_default_context(cafile=str(settings.nats_tls_ca))
    try:
        await nc.connect(**options)  # type: ignore[arg-type]
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        where = ",".join(redact(u) for u in servers)
        if settings.nats_url is None and no_url and _held(settings.data / UP_LOCK_FILE):
            # An `up` holds the data dir but has written no `nats.url`: it writes it once its
            # streams take messages (a cluster elects for seconds), and removes it as it stops.
            data = settings.data.resolve()
            raise NatsUnavailable(
                f"the `runfleet up` fleet on {data} is starting or stopping: it has not written"
                f" {NATS_URL_FILE} (it does once its streams take messages)",
                remedy="wait until `runfleet up` prints that it runs, then retry; an `up` on a"
                " NATS of its own (RUNFLEET_NATS_URL) writes no such file: set the same"
                " RUNFLEET_NATS_URL here",
            ) from exc
        if settings.nats_url is None and no_url:
            # Neither RUNFLEET_NATS_URL nor a fleet's `nats.url`: the fallback address was
            # tried, and what the person needs to hear is that no fleet runs here.
            data = settings.data.resolve()
            raise NatsUnavailable(
                f"no `runfleet up` fleet is running on {data} (no {NATS_URL_FILE} there), and"
                f" nothing answers at the default {where}: {exc!r}",
                remedy="start one (`runfleet up`, or `runfleet up --data DIR`), set"
                " RUNFLEET_DATA to the directory a running `up` uses, or set RUNFLEET_NATS_URL",
            ) from exc
        if settings.nats_url is None and not _held(settings.data / UP_LOCK_FILE):
            # Nothing holds the fleet's lock: the `up` that wrote `nats.url` is gone with all
            # it started, and the file is left (found by a walkthrough: "retry in a few
            # seconds" for a fleet no one runs).
            data = settings.data.resolve()
            raise NatsUnavailable(
                f"no `runfleet up` fleet is running on {data}: its {NATS_URL_FILE} ({where})"
                f" is left from one that is gone: {exc!r}",
                remedy=f"start the fleet again (`runfleet up`); it writes a new {NATS_URL_FILE}",
            ) from exc
        if settings.nats_url is None:
            # A fleet's `nats.url` names a server that does not answer: its `up` restarts a
            # nats-server that died within seconds; an `up` that is gone left the file behind.
            data = settings.data.resolve()
            raise NatsUnavailable(
                f"the `runfleet up` fleet on {data} does not answer at {where}: {exc!r}",
                remedy="retry in a few seconds (`runfleet up` restarts a nats-server that"
                " died); one that hangs without dying (`up.log` says it does not answer) is"
                f" stopped with `pkill -f 'nats-server.*{data / 'nats'}'`, and `up` starts it"
                f" again; if that `up` is gone, stop what still holds {data / 'up.lock'} and"
                " start the fleet again (`runfleet up`)",
            ) from exc
        raise NatsUnavailable(f"cannot reach NATS at {where}: {exc!r}") from exc
    nc.options["max_reconnect_attempts"] = -1  # connected: from now on, never give up
    return nc, nc.jetstream()


def _held(lock: Path) -> bool:
    """Whether a process holds the fleet's OS lock (a shared probe, released at once: a
    missing file is no fleet, a file no one holds is a fleet that is gone)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True  # cannot tell: say what was said before
    finally:
        os.close(fd)  # drops the probe's own lock
    return False


async def _log_error(exc: Exception) -> None:
    log.warning("nats: %r", exc)
