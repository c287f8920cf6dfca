"""Connecting to NATS, with its errors translated at this boundary (NatsUnavailable)."""

from __future__ import annotations

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

from publisher.config import WireSettings
from publisher.errors import NatsUnavailable
from store.url import redact


async def connect(
    settings: WireSettings, *, name: str = "runfleet"
) -> tuple[Client, JetStreamContext]:
    url = settings.effective_nats_url()
    options: dict[str, object] = {
        "servers": [url],
        "name": name,
        "connect_timeout": 2,
        "max_reconnect_attempts": -1,
        "allow_reconnect": True,
    }
    if settings.nats_creds is not None:
        options["user_credentials"] = str(settings.nats_creds)
    if settings.nats_tls_ca is not None:
        import ssl

        options["tls"] = ssl.create_default_context(cafile=str(settings.nats_tls_ca))
    try:
        nc = await nats.connect(**options)  # type: ignore[arg-type]
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        raise NatsUnavailable(f"cannot reach NATS at {redact(url)}: {exc!r}") from exc
    return nc, nc.jetstream()
