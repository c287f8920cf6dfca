"""MongoDB-only behaviour of `MongoRunStore` that the shared conformance suite cannot see:
URL handling, the typed errors of an unreachable server, retries of transient driver errors
(including a write that landed before its connection dropped), lazy indexes, and appends from
several processes sharing one database."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import mongomock_motor
import pytest
from pymongo import AsyncMongoClient, ReadPreference
from pymongo.errors import AutoReconnect, OperationFailure, PyMongoError, WriteConcernError

from store.cas import CasConflict, Eq, Update
from store.errors import (
    InvalidStoreUrl,
    RunAlreadyExists,
    StoreError,
    StoreUnavailable,
)
from store.models import Lease, RunDocument, RunStatus, WorkflowRef
from store.mongo import MongoRunStore, redact_url
from store.mongo.connection import durable_database
from store.protocols import EventDraft
from store.timeutil import utcnow


def _db() -> Any:
    return mongomock_motor.AsyncMongoMockClient(tz_aware=True)[f"t_{uuid.uuid4().hex}"]


def _run(run_id: str | None = None, **overrides: Any) -> RunDocument:
    now = utcnow()
    source = "name: w\nnodes: []\n"
    fields: dict[str, Any] = {
        "run_id": run_id or uuid.uuid4().hex,
        "workflow": WorkflowRef(
            name="w", source=source, source_hash=hashlib.sha256(source.encode()).hexdigest()
        ),
        "status": RunStatus.QUEUED,
        "attempt_at": now,
        "created_at": now,
        "updated_at": now,
    }
    return RunDocument(**{**fields, **overrides})


class Faulty:
    """A collection (or database) proxy that injects `AutoReconnect` into named methods: `before`
    fails the call without running it, `after` runs it and then loses the reply. Every await
    also yields, so concurrent callers interleave as they would against a real server."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self.before: dict[str, int] = {}
        self.after: dict[str, int] = {}
        self._children: dict[str, Faulty] = {}

    def __getitem__(self, name: str) -> Faulty:
        return self._children.setdefault(name, Faulty(self._target[name]))

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(0)
            if self.before.get(name, 0) > 0:
                self.before[name] -= 1
                raise AutoReconnect("connection lost before the request was sent")
            result = await attr(*args, **kwargs)
            if self.after.get(name, 0) > 0:
                self.after[name] -= 1
                raise AutoReconnect("connection lost after the write was applied")
            return result

        return call


@pytest.fixture
def faulty() -> Iterator[Faulty]:
    yield Faulty(_db())


# -- URLs and connecting ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("mongodb://user:s3cret@db:27017/runfleet", "mongodb://***@db:27017/runfleet"),
        (
            "mongodb+srv://u:p@cluster.example/x?authSource=admin",
            "mongodb+srv://***@cluster.example/x?authSource=admin",
        ),
        ("mongodb://a:1,b:2/db", "mongodb://a:1,b:2/db"),
        ("mongodb://token@h/db", "mongodb://***@h/db"),
    ],
)
def test_redact_url_hides_credentials(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_unreachable_server_is_store_unavailable_naming_the_redacted_url() -> None:
    url = f"mongodb://runner:hunter2@127.0.0.1:{_unused_port()}/runfleet"
    with pytest.raises(StoreUnavailable) as caught:
        await MongoRunStore.connect(url, server_selection_timeout_ms=100, retry_attempts=2)
    message = caught.value.message
    assert "***@127.0.0.1" in message
    assert "hunter2" not in message and "runner" not in message
    assert caught.value.to_dict()["code"] == "store_unavailable"


@pytest.mark.parametrize(
    "url",
    ["http://db/x", "mongodb://", "mongodb://u:pa:ss@h:notaport/db"],
)
async def test_malformed_url_is_invalid_store_url_without_the_password(url: str) -> None:
    with pytest.raises(InvalidStoreUrl) as caught:
        await MongoRunStore.connect(url, server_selection_timeout_ms=100, retry_attempts=1)
    assert "pa:ss" not in caught.value.message


# -- indexes -----------------------------------------------------------------------------------


async def test_indexes_are_created_before_the_first_write_even_if_nobody_asked() -> None:
    db = _db()
    store = MongoRunStore(db)
    await store.append_event("r", "run_launched")
    info = await db["events"].index_information()
    unique = [v for v in info.values() if v.get("unique")]
    assert [spec["key"] for spec in unique] == [[("run_id", 1), ("seq", 1)]]
    await store.ensure_indexes()  # idempotent
    assert await db["events"].index_information() == info


# -- storage form ----------------------------------------------------------------------------


async def test_models_and_instants_in_an_update_are_stored_as_plain_data() -> None:
    db = _db()
    store = MongoRunStore(db)
    doc = await store.create_run(_run())
    expires = utcnow() + timedelta(seconds=30)
    lease = Lease(owner="r1", token="tok", attempt=1, expires_at=expires)
    result = await store.update_run(
        doc.run_id,
        [Eq("status", RunStatus.QUEUED)],
        Update(set={"status": RunStatus.RUNNING, "lease": lease}),
    )
    assert isinstance(result, RunDocument) and result.lease == lease
    raw = await db["runs"].find_one({"_id": doc.run_id})
    assert raw["lease"]["expires_at"] == int(expires.timestamp() * 1000)
    assert raw["status"] == "running" and isinstance(raw["created_at"], int)


# -- transient errors ------------------------------------------------------------------------


async def test_transient_errors_are_retried_then_become_store_unavailable(faulty: Faulty) -> None:
    store = MongoRunStore(faulty, retry_attempts=3)  # type: ignore[arg-type]
    doc = await store.create_run(_run())
    faulty["runs"].before["find_one"] = 2
    assert await store.get_run(doc.run_id) == doc  # third attempt succeeds
    faulty["runs"].before["find_one"] = 3
    with pytest.raises(StoreUnavailable) as caught:
        await store.get_run(doc.run_id)
    assert isinstance(caught.value.__cause__, AutoReconnect)


async def test_other_driver_errors_become_store_error_with_the_cause() -> None:
    class Broken:
        def __getitem__(self, name: str) -> Broken:
            return self

        async def find_one(self, *args: Any, **kwargs: Any) -> None:
            raise OperationFailure("not authorized on runfleet", code=13)

    store = MongoRunStore(Broken())  # type: ignore[arg-type]
    store._indexed = True  # Broken has no create_index
    with pytest.raises(StoreError) as caught:
        await store.get_run("r")
    assert not isinstance(caught.value, StoreUnavailable)
    assert isinstance(caught.value.__cause__, OperationFailure)


async def test_a_create_whose_reply_was_lost_is_not_reported_as_a_duplicate(
    faulty: Faulty,
) -> None:
    store = MongoRunStore(faulty)  # type: ignore[arg-type]
    faulty["runs"].after["insert_one"] = 1
    doc = await store.create_run(_run())
    assert await store.get_run(doc.run_id) == doc
    with pytest.raises(RunAlreadyExists):  # a real duplicate is still refused
        await store.create_run(_run(doc.run_id, tenant="other"))


async def test_a_cas_whose_reply_was_lost_is_reported_as_won(faulty: Faulty) -> None:
    store = MongoRunStore(faulty)  # type: ignore[arg-type]
    doc = await store.create_run(_run())
    faulty["runs"].after["find_one_and_update"] = 1
    result = await store.update_run(
        doc.run_id, [Eq("version", 1)], Update(set={"error": "first attempt landed"})
    )
    assert isinstance(result, RunDocument) and result.version == 2
    again = await store.update_run(doc.run_id, [Eq("version", 1)], Update(set={"error": "x"}))
    assert isinstance(again, CasConflict)


async def test_an_append_whose_reply_was_lost_is_not_appended_twice(faulty: Faulty) -> None:
    store = MongoRunStore(faulty)  # type: ignore[arg-type]
    faulty["events"].after["insert_one"] = 1
    first = await store.append_event("r", "run_launched")
    second = await store.append_event("r", "run_queued")
    assert (first.seq, second.seq) == (1, 2)
    assert [e.type for e in await store.read_events("r")] == ["run_launched", "run_queued"]


# -- several processes -----------------------------------------------------------------------


async def test_appenders_in_several_processes_get_gap_free_sequences(faulty: Faulty) -> None:
    """Each store stands for a process (its own locks and remembered seqs); only the unique
    `(run_id, seq)` index keeps them apart."""
    stores = [MongoRunStore(faulty) for _ in range(3)]  # type: ignore[arg-type]

    async def appender(n: int) -> None:
        for i in range(20):
            await stores[(n + i) % len(stores)].append_event("r", "node_finished", {"n": n})

    await asyncio.gather(*(appender(n) for n in range(10)))
    assert [e.seq for e in await stores[0].read_events("r")] == list(range(1, 201))


# -- a Mongo store review (twenty-fourth pass) -----------------------------------------------


async def test_a_write_whose_events_meet_another_process_append_lands_them_once_in_order() -> None:
    """`insert_many` of a write's events collides with an append by another process (a
    resume from the CLI while a runner holds the run): the write lands, its events follow the
    other's in order, and the next write numbers after them. The bulk duplicate was translated
    to `StoreError`, so the write raised after its document moved and its events were lost."""
    db = _db()
    runner, operator = MongoRunStore(db), MongoRunStore(db)
    drafts = [EventDraft("run_launched", {}), EventDraft("run_queued", {})]
    doc = await runner.create_run(_run(), events=drafts)  # the runner remembers seq 2
    await operator.append_event(doc.run_id, "run_resumed")  # seq 3, behind its back

    done = await runner.update_run(
        doc.run_id,
        [Eq("version", 1)],
        Update(set={"error": "x"}),
        events=[EventDraft("node_started", {}), EventDraft("node_finished", {})],
    )
    assert isinstance(done, RunDocument) and done.version == 2
    again = await runner.update_run(
        doc.run_id,
        [Eq("version", 2)],
        Update(set={"error": "y"}),
        events=[EventDraft("node_started", {}), EventDraft("run_finished", {})],
    )
    assert isinstance(again, RunDocument)
    assert [(e.seq, e.type) for e in await runner.read_events(doc.run_id)] == [
        (1, "run_launched"),
        (2, "run_queued"),
        (3, "run_resumed"),
        (4, "node_started"),
        (5, "node_finished"),
        (6, "node_started"),
        (7, "run_finished"),
    ]


async def test_an_events_insert_whose_reply_was_lost_is_not_appended_twice(faulty: Faulty) -> None:
    store = MongoRunStore(faulty)  # type: ignore[arg-type]
    doc = await store.create_run(_run())
    faulty["events"].after["insert_many"] = 1  # landed, then the connection dropped

    done = await store.update_run(
        doc.run_id,
        [Eq("version", 1)],
        Update(set={"error": "x"}),
        events=[EventDraft("node_started", {}), EventDraft("node_finished", {})],
    )
    await store.append_event(doc.run_id, "run_finished")

    assert isinstance(done, RunDocument)
    assert [(e.seq, e.type) for e in await store.read_events(doc.run_id)] == [
        (1, "node_started"),
        (2, "node_finished"),
        (3, "run_finished"),
    ]


@pytest.mark.parametrize(
    "error",
    [
        OperationFailure("not primary", code=10107),
        OperationFailure("interrupted due to repl state change", code=11602),
        OperationFailure("shutdown in progress", code=91),
        WriteConcernError("waiting for replication timed out", code=64),
    ],
    ids=["not-primary", "repl-state-change", "shutdown", "write-concern"],
)
async def test_an_election_or_an_unmet_write_concern_is_store_unavailable(
    error: PyMongoError,
) -> None:
    """An operator's command is exit 4 and the API 503 while a replica set elects, as for a
    lost connection; it was `StoreError` (exit 1, 500)."""

    class Electing:
        def __getitem__(self, name: str) -> Electing:
            return self

        async def find_one(self, *args: Any, **kwargs: Any) -> None:
            raise error

    store = MongoRunStore(Electing())  # type: ignore[arg-type]
    store._indexed = True
    with pytest.raises(StoreUnavailable) as caught:
        await store.get_run("r")
    assert caught.value.__cause__ is error


def test_the_database_is_opened_majority_durable_whatever_the_url_asks() -> None:
    """A claim, a lease or an event acknowledged by one member can roll back at a failover;
    a secondary's read feeds a stale document to the CAS. Opened without I/O."""
    client: Any = AsyncMongoClient(
        "mongodb://127.0.0.1:1/fleet?w=1&readPreference=secondary&readConcernLevel=majority",
        connect=False,
    )
    db = durable_database(client, None)
    assert db.name == "fleet"
    assert db.write_concern.document == {"w": "majority", "j": True}
    assert db.read_preference == ReadPreference.PRIMARY
    # the server's own read concern: a `majority` one kept the CAS's pre-read behind a write
    # not yet majority-committed, and its tries ended in a conflict read as a lost lease
    assert db.read_concern.level is None


async def test_listings_by_status_and_tenant_have_indexes_that_page_by_id() -> None:
    db = _db()
    await MongoRunStore(db).ensure_indexes()
    keys = [spec["key"] for spec in (await db["runs"].index_information()).values()]
    assert [("status", 1), ("_id", 1)] in keys
    assert [("tenant", 1), ("_id", 1)] in keys
    assert [("tenant", 1), ("status", 1), ("_id", 1)] in keys
