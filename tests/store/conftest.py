"""One `run_store` per backend, so the conformance suite runs the same tests on each (SPEC §9).

- `sqlite`: a fresh file under `tmp_path`, always.
- `mongomock`: mongomock-motor with `tz_aware=True` and a uuid-named database, always.
- `mongo`: a real `mongod` at `MONGODB_URI`, a uuid-named database dropped afterwards; skipped
  with a visible reason when the variable is not set.

`store_backend.open_another()` opens another instance on the same storage, as another process
would. `store_backend.put_raw_run` / `get_raw_run` reach under the store (a raw sqlite3
connection, the database object) to plant a document the store would never write, and to check
that it was not rewritten. `open_backend(name, tmp_path)` opens a backend outside the fixture,
for the tests that compare two backends' stored documents field for field.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import json
import os
import sqlite3
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uuid6

from store.models import RunDocument, RunStatus, WorkflowRef
from store.mongo import MongoRunStore
from store.protocols import RunStore
from store.sqlite import SqliteRunStore
from store.timeutil import utcnow

RawDoc = dict[str, Any]

WORKFLOW_SOURCE = """\
name: hello
nodes:
  - id: greet
    run: echo hello
"""


@dataclass
class Backend:
    name: str
    store: RunStore
    put_raw_run: Callable[[RawDoc], Awaitable[None]]
    """Insert a run document in storage form, bypassing every check of the store."""
    get_raw_run: Callable[[str], Awaitable[RawDoc | None]]
    """The run document exactly as stored (without Mongo's `_id`), or None."""
    open_another: Callable[[], Awaitable[RunStore]]
    """Another store instance on the same file or database, as another process would open
    (closed by the fixture)."""


def _sqlite_raw(path: Path) -> tuple[Callable[..., Awaitable[None]], Callable[..., Awaitable[Any]]]:
    def put(doc: RawDoc) -> None:
        lease = doc.get("lease") or {}
        with closing(sqlite3.connect(path)) as conn, conn:
            conn.execute(
                "INSERT INTO runs (run_id, tenant, status, origin, failure_code,"
                " lease_expires_ms, created_ms, updated_ms, doc)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    doc["run_id"],
                    doc.get("tenant", "default"),
                    doc.get("status", "queued"),
                    doc.get("origin", "fleet"),
                    doc.get("failure_code"),
                    lease.get("expires_at"),
                    doc.get("created_at", 0),
                    doc.get("updated_at", 0),
                    json.dumps(doc),
                ),
            )

    def get(run_id: str) -> RawDoc | None:
        with closing(sqlite3.connect(path)) as conn:
            row = conn.execute("SELECT doc FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    async def put_async(doc: RawDoc) -> None:
        await asyncio.to_thread(put, doc)

    async def get_async(run_id: str) -> RawDoc | None:
        return await asyncio.to_thread(get, run_id)

    return put_async, get_async


class Suspending:
    """A mongomock-motor database (or collection, or cursor) whose calls suspend.

    mongomock-motor's coroutines never suspend, so concurrent tasks could never interleave
    inside the store and every race test would pass trivially. A real driver suspends at each
    round trip; this proxy adds that suspension point before and after every call, so a
    read-then-insert (event append) or a read-then-write can be raced on mongomock too.
    """

    _CHAINING = frozenset({"find", "limit", "sort", "skip"})

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getitem__(self, name: str) -> Suspending:
        return Suspending(self._target[name])

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if inspect.iscoroutinefunction(attr):

            @functools.wraps(attr)
            async def call(*args: Any, **kwargs: Any) -> Any:
                await asyncio.sleep(0)
                result = await attr(*args, **kwargs)
                await asyncio.sleep(0)
                return result

            return call
        if name in self._CHAINING:

            @functools.wraps(attr)
            def chain(*args: Any, **kwargs: Any) -> Suspending:
                return Suspending(attr(*args, **kwargs))

            return chain
        return attr


def _mongo_raw(db: Any) -> tuple[Callable[..., Awaitable[None]], Callable[..., Awaitable[Any]]]:
    async def put(doc: RawDoc) -> None:
        await db["runs"].insert_one({**doc, "_id": doc["run_id"]})

    async def get(run_id: str) -> RawDoc | None:
        raw = await db["runs"].find_one({"_id": run_id})
        if raw is None:
            return None
        raw.pop("_id", None)
        return dict(raw)

    return put, get


@asynccontextmanager
async def open_backend(name: str, tmp_path: Path) -> AsyncIterator[Backend]:
    """The backend `name` ("sqlite", "mongomock", "mongo") on fresh storage under `tmp_path`,
    closed (and a real database dropped) on exit; for tests that hold two backends at once."""
    opened: list[RunStore] = []
    client: Any = None
    db_name = f"runfleet_test_{uuid.uuid4().hex}"
    try:
        if name == "sqlite":
            path = tmp_path / "runs.db"

            async def open_store() -> RunStore:
                return await SqliteRunStore.open(path)

            put, get = _sqlite_raw(path)
        elif name == "mongomock":
            import mongomock_motor

            db = mongomock_motor.AsyncMongoMockClient(tz_aware=True)[db_name]

            async def open_store() -> RunStore:
                store = MongoRunStore(Suspending(db))  # type: ignore[arg-type]
                await store.ensure_indexes()
                return store

            put, get = _mongo_raw(db)
        else:
            uri = os.environ.get("MONGODB_URI")
            if not uri:
                pytest.skip("MONGODB_URI not set: no real mongod on this machine")
            from pymongo import AsyncMongoClient

            client = AsyncMongoClient(uri, tz_aware=True, serverSelectionTimeoutMS=5000)
            real_db = client[db_name]

            async def open_store() -> RunStore:
                store = MongoRunStore(real_db)
                await store.ensure_indexes()
                return store

            put, get = _mongo_raw(real_db)

        async def open_another() -> RunStore:
            store = await open_store()
            opened.append(store)
            return store

        yield Backend(name, await open_another(), put, get, open_another)
    finally:
        for store in opened:
            await store.close()
        if client is not None:
            await client.drop_database(db_name)
            await client.close()


MONGO_BACKENDS = ["mongomock", pytest.param("mongo", marks=pytest.mark.mongo_real)]


@pytest.fixture(params=["sqlite", *MONGO_BACKENDS])
async def store_backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    async with open_backend(request.param, tmp_path) as backend:
        yield backend


@pytest.fixture
def run_store(store_backend: Backend) -> RunStore:
    """The store under test, once per backend."""
    return store_backend.store


def workflow_ref(source: str = WORKFLOW_SOURCE, name: str = "hello") -> WorkflowRef:
    return WorkflowRef(
        name=name, source=source, source_hash=hashlib.sha256(source.encode()).hexdigest()
    )


MakeRun = Callable[..., RunDocument]


@pytest.fixture
def make_run() -> MakeRun:
    """`make_run(**overrides)`: a valid queued run at attempt 1 with a fresh UUIDv7 id."""

    def make(**overrides: Any) -> RunDocument:
        now = utcnow()
        fields: dict[str, Any] = {
            "run_id": str(uuid6.uuid7()),
            "tenant": "default",
            "workflow": workflow_ref(),
            "status": RunStatus.QUEUED,
            "attempt": 1,
            "attempt_at": now,
            "created_at": now,
            "updated_at": now,
        }
        fields.update(overrides)
        return RunDocument(**fields)

    return make
