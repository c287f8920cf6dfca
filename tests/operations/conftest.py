"""Fixtures for the operations tests: an `Env` as the CLI opens one — a real SQLite store, a
filesystem blob store, the session's real nats-server with uuid-scoped streams — but built from
settings stated in full, so no `RUNFLEET_*` variable of the machine running the tests leaks in.

The NATS, store and naming fixtures are the publisher tests' own (re-exported here).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.config import EngineSettings
from publisher import DlqStore, WireNames, WireSettings, ensure_streams
from runner.operations import Env
from store import RunStore
from store.blobs_fs import FilesystemBlobStore
from store.config import StoreSettings
from tests.publisher import conftest as publisher_fixtures
from tests.publisher.conftest import Nats, wire_settings
from tests.support.nats_server import NatsServer

# The publisher tests' fixtures, by the names tests ask for.
names = publisher_fixtures.names
nats_conn = publisher_fixtures.nats_conn
run_store = publisher_fixtures.run_store

ENGINE = {
    "sandbox": "local",
    "lease_ttl": "3s",
    "lease_interval": "1s",
    "lease_skew": "0.5s",
    "lease_loss_margin": "0.5s",
    "node_cancel_budget": "5s",
    "teardown_budget": "10s",
    "scratch_bank_budget": "5s",
    "post_engine_budget": "5s",
    "unwind_margin": "1s",
}


@pytest.fixture
def wire(nats_server: NatsServer, names: WireNames, tmp_path: Path) -> WireSettings:
    return wire_settings(
        nats_url=nats_server.url, namespace=names.namespace, data=tmp_path / "data"
    )


@pytest.fixture
async def env(
    run_store: RunStore, wire: WireSettings, nats_conn: Nats, tmp_path: Path
) -> AsyncIterator[Env]:
    """An environment whose streams exist (`streams ensure` ran); `nats_conn` deletes them
    after the test."""
    await ensure_streams(nats_conn.js, WireNames(wire.namespace), wire)
    blobs = FilesystemBlobStore(tmp_path / "data" / "blobs")
    settings = StoreSettings(data=tmp_path / "data", tenant="default")
    engine = EngineSettings(**ENGINE)  # type: ignore[arg-type]
    try:
        yield Env(settings, engine, run_store, blobs, "runfleet-test", wire)
    finally:
        await blobs.close()


@pytest.fixture
def dlq(nats_conn: Nats, names: WireNames) -> DlqStore:
    """The test's DLQ stream, read and written directly (what a runner would have left)."""
    return DlqStore(nats_conn.js, names, None)
