"""Fixtures shared by the whole suite: a real JetStream server and uuid-scoped names."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Import runfleet's packages from this checkout even when it is not installed, and before
# `tests/` (which pytest puts on sys.path for this file): a `tests/store` directory must never
# shadow the real `store` package.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.support.nats_server import NatsServer  # noqa: E402


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One `nats-server -js` per session on a free port with a temporary store directory.

    Tests isolate themselves by uuid-prefixed stream names (`nats_prefix`). A test that calls
    `stop()` must `start()` it again (in a `finally`): it comes back on the same port and
    store directory, with its JetStream data.
    """
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_prefix() -> str:
    """A fresh prefix for stream, consumer and subject names (valid in all three)."""
    return f"t{uuid.uuid4().hex[:16]}"
