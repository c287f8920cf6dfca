"""Fixtures for the publisher tests: a real JetStream (the session `nats_server`), uuid-scoped
`WireNames`, a real run store (SQLite by default; mongomock where a test parametrises
`run_store`), and a `Publisher` wired to them after `ensure_streams`.

Helpers read the work stream back with `js.get_msg`, so a test checks what is really on the
wire, not what the publisher says it put there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
import uuid6
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from engine.loader import LoadedWorkflow, load_workflow_file
from publisher import DlqStore, Publisher, WireNames, WireSettings, ensure_streams
from store import (
    Checkpoint,
    Lease,
    RunDocument,
    RunStatus,
    RunStore,
    WorkflowRef,
    utcnow,
)
from store.sqlite import SqliteRunStore
from tests.support.nats_server import NatsServer

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

FAST_PUBLISH = {"publish_attempts": 2, "publish_retry_budget": "2s", "publish_timeout": "0.5s"}
"""Bounded retries that give up in about a second when NATS is gone."""


def wire_settings(**overrides: Any) -> WireSettings:
    """Settings stated in full, so a stray `RUNFLEET_*` variable cannot change a test."""
    fields: dict[str, Any] = {
        "namespace": "",
        "max_deliver": 10,
        "lease_ttl": "30s",
        "lease_skew": "2s",
        "ack_wait": None,
        "duplicate_window": "5m",
        "stream_replicas": 1,
        **FAST_PUBLISH,
    }
    fields.update(overrides)
    return WireSettings(**fields)


@pytest.fixture
def names() -> WireNames:
    return WireNames(namespace=f"t{uuid.uuid4().hex[:16]}")


async def delete_streams(js: JetStreamContext, names: WireNames) -> None:
    for stream in (names.runs_stream, names.advisory_stream, names.dlq_stream):
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(stream)


@dataclass
class Nats:
    nc: Client
    js: JetStreamContext


@pytest.fixture
async def nats_conn(nats_server: NatsServer, names: WireNames) -> AsyncIterator[Nats]:
    """A connection to the session server; the test's streams are deleted afterwards."""
    nc = await nats.connect(nats_server.url, connect_timeout=5, max_reconnect_attempts=5)
    js = nc.jetstream()
    try:
        yield Nats(nc, js)
    finally:
        try:
            await delete_streams(js, names)
        finally:
            await nc.close()


@pytest.fixture(params=["sqlite"])
async def run_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[RunStore]:
    """A real run store: SQLite unless a test parametrises it (`indirect=True`) with
    `mongomock` too."""
    kind: str = request.param
    if kind == "sqlite":
        sqlite_store = await SqliteRunStore.open(tmp_path / "runs.db")
        try:
            yield sqlite_store
        finally:
            await sqlite_store.close()
    elif kind == "mongomock":
        import mongomock_motor

        from store.mongo import MongoRunStore

        client = mongomock_motor.AsyncMongoMockClient(tz_aware=True)
        mongo_store = MongoRunStore(client[f"runfleet_test_{uuid.uuid4().hex}"])
        await mongo_store.ensure_indexes()
        try:
            yield mongo_store
        finally:
            await mongo_store.close()
    else:  # pragma: no cover - a typo in a parametrisation
        raise ValueError(f"unknown store {kind!r}")


@pytest.fixture
def settings() -> WireSettings:
    return wire_settings()


@pytest.fixture
async def publisher(
    run_store: RunStore, nats_conn: Nats, names: WireNames, settings: WireSettings
) -> Publisher:
    await ensure_streams(nats_conn.js, names, settings)
    return Publisher(
        store=run_store,
        nc=nats_conn.nc,
        js=nats_conn.js,
        settings=settings,
        names=names,
        dlq=DlqStore(nats_conn.js, names, None),
    )


# -- workflows and runs ---------------------------------------------------------------------


def example(name: str) -> LoadedWorkflow:
    return load_workflow_file(EXAMPLES / name)


def workflow_ref(loaded: LoadedWorkflow) -> WorkflowRef:
    return WorkflowRef(
        name=loaded.workflow.name, source=loaded.source, source_hash=loaded.source_hash
    )


def approval_pending() -> dict[str, Any]:
    """The checkpoint's pending interaction of `examples/approval.yaml` paused at `review`."""
    return {
        "id": f"ix-{uuid.uuid4().hex[:8]}",
        "node": "review",
        "questions": [
            {"name": "approved", "type": "bool", "required": True},
            {"name": "note", "type": "string", "required": False},
        ],
    }


async def put_run(
    store: RunStore,
    *,
    status: RunStatus,
    workflow: str = "hello.yaml",
    attempt: int = 1,
    tenant: str = "default",
    checkpoint: Checkpoint | None = None,
    **fields: Any,
) -> RunDocument:
    """Create a run directly in the store, as an execution would have left it."""
    now = utcnow()
    doc = RunDocument(
        run_id=str(uuid6.uuid7()),
        tenant=tenant,
        workflow=workflow_ref(example(workflow)),
        status=status,
        attempt=attempt,
        attempt_at=now,
        checkpoint=checkpoint if checkpoint is not None else Checkpoint(progress=1),
        created_at=now,
        updated_at=now,
        **fields,
    )
    return await store.create_run(doc)


def live_lease(attempt: int = 1) -> Lease:
    return Lease(
        owner="runner-a",
        token=uuid.uuid4().hex,
        attempt=attempt,
        expires_at=utcnow() + timedelta(minutes=5),
    )


def expired_lease(attempt: int = 1) -> Lease:
    """Expired well past any skew: "lease free" (SPEC §2)."""
    return Lease(
        owner="runner-gone",
        token=uuid.uuid4().hex,
        attempt=attempt,
        expires_at=utcnow() - timedelta(minutes=5),
    )


# -- reading the wire back -------------------------------------------------------------------


async def stream_messages(js: JetStreamContext, names: WireNames) -> list[RawStreamMsg]:
    """Every message on the work stream, in sequence order."""
    out: list[RawStreamMsg] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(
                names.runs_stream, seq=seq, subject=names.runs_subject, next=True
            )
        except NotFoundError:
            return out
        assert msg.seq is not None
        out.append(msg)
        seq = msg.seq + 1


async def stream_count(js: JetStreamContext, names: WireNames) -> int:
    info = await js.stream_info(names.runs_stream)
    return info.state.messages


def body(msg: RawStreamMsg) -> dict[str, Any]:
    assert msg.data is not None
    loaded = json.loads(msg.data)
    assert isinstance(loaded, dict)
    return loaded


async def event_types(store: RunStore, run_id: str) -> list[str]:
    return [e.type for e in await store.read_events(run_id)]


class BarrierOnFirstReads:
    """A `RunStore` whose first `parties` `get_run` calls wait for each other after reading.

    Two concurrent resumes then both judge the same (resumable) document before either writes,
    so the compare-and-set itself, not the order the event loop happened to pick, decides the
    winner.
    """

    def __init__(self, inner: RunStore, parties: int = 2) -> None:
        self._inner = inner
        self._barrier = asyncio.Barrier(parties)
        self._left = parties

    async def get_run(self, run_id: str) -> RunDocument:
        doc = await self._inner.get_run(run_id)
        if self._left > 0:
            self._left -= 1
            async with asyncio.timeout(10):
                await self._barrier.wait()
        return doc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
