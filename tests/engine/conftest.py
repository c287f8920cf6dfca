"""Fixtures for the engine's execution tests (SPEC §5.3 Local, §5.4, §6, §13).

- `store`: a real `RunStore` once per backend: SQLite in a file under `tmp_path`, and MongoDB
  through mongomock-motor (`tz_aware=True`, a uuid-named database, indexes ensured). A real
  `mongod` is the store conformance suite's business.
- `env`: the `LocalEnv` `runfleet run` builds, on that store and a real local sandbox driver.
- `claim`: a `running` run holding a fresh lease, as the local claim writes it, for tests that
  drive an `Execution`, a `LeaseKeeper` or a `FencedWriter` by hand.
- `poll`: waits are polls of the condition itself with a deadline, never bare sleeps.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from engine.config import EngineSettings
from engine.events import EventLog
from engine.loader import LoadedWorkflow, load_workflow_file
from engine.local import LocalEnv, new_run_id, owner_name
from engine.sandbox.local import LocalSandboxDriver
from engine.vars import resolve_vars
from store import (
    Budget,
    Event,
    Lease,
    Origin,
    RunDocument,
    RunStatus,
    RunStore,
    WorkflowRef,
    utcnow,
)
from store.mongo import MongoRunStore
from store.sqlite import SqliteRunStore

T = TypeVar("T")

WORKFLOWS = Path(__file__).resolve().parent / "workflows"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


Poll = Callable[..., Awaitable[Any]]
Claim = Callable[..., Awaitable[tuple[RunDocument, str]]]


@pytest.fixture(params=["sqlite", "mongomock"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[RunStore]:
    if request.param == "sqlite":
        sqlite_store = await SqliteRunStore.open(tmp_path / "runs.db")
        try:
            yield sqlite_store
        finally:
            await sqlite_store.close()
    else:
        import mongomock_motor

        client: Any = mongomock_motor.AsyncMongoMockClient(tz_aware=True)
        mongo_store = MongoRunStore(client[f"runfleet_engine_{uuid.uuid4().hex}"])
        await mongo_store.ensure_indexes()
        try:
            yield mongo_store
        finally:
            await mongo_store.close()


@pytest.fixture
def env(store: RunStore, tmp_path: Path) -> LocalEnv:
    return LocalEnv(store, LocalSandboxDriver(tmp_path), EngineSettings(), tmp_path)


def workflow(name: str) -> LoadedWorkflow:
    """`name` from `tests/engine/workflows/`, or `examples/` when prefixed `examples/`."""
    if name.startswith("examples/"):
        return load_workflow_file(EXAMPLES / f"{name.removeprefix('examples/')}.yaml")
    return load_workflow_file(WORKFLOWS / f"{name}.yaml")


@pytest.fixture
def fast_lease() -> EngineSettings:
    """A lease keeper that beats ten times a second, so a refresh's read is seen quickly."""
    return EngineSettings(
        lease_ttl=timedelta(seconds=0.9),
        lease_interval=timedelta(seconds=0.1),
        lease_skew=timedelta(seconds=0.1),
    )


@pytest.fixture
def load() -> Callable[[str], LoadedWorkflow]:
    return workflow


async def all_events(store: RunStore, run_id: str) -> list[Event]:
    return await store.read_events(run_id, after_seq=0, limit=100_000)


@pytest.fixture
def events(store: RunStore) -> Callable[[str], Awaitable[list[Event]]]:
    async def read(run_id: str) -> list[Event]:
        return await all_events(store, run_id)

    return read


async def poll_until(
    read: Callable[[], Awaitable[T]],
    ok: Callable[[T], bool],
    *,
    within: float = 10.0,
    every: float = 0.02,
    what: str = "condition",
) -> T:
    """Re-read until `ok(value)`; fail with the last value read once `within` seconds
    have passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        value = await read()
        if ok(value):
            return value
        if loop.time() >= deadline:
            raise AssertionError(f"{what} not met within {within}s; last read: {value!r}")
        await asyncio.sleep(every)


@pytest.fixture
def poll() -> Poll:
    return poll_until


async def claim_new(
    store: RunStore,
    loaded: LoadedWorkflow,
    inputs: dict[str, Any] | None = None,
    *,
    settings: EngineSettings | None = None,
) -> tuple[RunDocument, str]:
    """Create a `local` run that is already `running` under a fresh lease (what `run_local`
    writes before it executes), with its launch events; returns the run and the lease token."""
    settings = settings or EngineSettings()
    inputs = inputs or {}
    resolve_vars(loaded.workflow, inputs)
    now = utcnow()
    token = uuid.uuid4().hex
    doc = RunDocument(
        run_id=new_run_id(),
        origin=Origin.LOCAL,
        workflow=WorkflowRef(
            name=loaded.workflow.name, source=loaded.source, source_hash=loaded.source_hash
        ),
        inputs=inputs,
        budget=Budget.model_validate(loaded.workflow.budget.model_dump()),
        status=RunStatus.RUNNING,
        attempt=1,
        attempt_at=now,
        lease=Lease(
            owner=owner_name(),
            token=token,
            attempt=1,
            expires_at=now + settings.lease_timing().ttl,
        ),
        created_at=now,
        updated_at=now,
    )
    created = await store.create_run(doc)
    log = EventLog(store, doc.run_id, 1, token)
    await log.emit("run_launched", workflow=loaded.workflow.name, origin="local")
    await log.emit("run_claimed", path="local", runner=owner_name())
    return created, token


@pytest.fixture
def claim(store: RunStore) -> Claim:
    async def make(
        loaded: LoadedWorkflow,
        inputs: dict[str, Any] | None = None,
        *,
        settings: EngineSettings | None = None,
    ) -> tuple[RunDocument, str]:
        return await claim_new(store, loaded, inputs, settings=settings)

    return make
