"""Group commit in `SqliteRunStore` (store/sqlite_worker.py): writes waiting together share one
transaction, each in its own savepoint, and none is reported before its commit."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from store.cas import CasConflict, Eq, Update
from store.errors import RunAlreadyExists, StoreError
from store.models import RunDocument
from store.sqlite import SqliteRunStore
from tests.store.conftest import MakeRun


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[SqliteRunStore]:
    store = await SqliteRunStore.open(tmp_path / "runs.db")
    yield store
    await store.close()


class Gate:
    """A write that holds the store's thread until released, so that writes submitted
    meanwhile queue up behind it and are taken as one batch."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, conn: sqlite3.Connection) -> None:
        self.entered.set()
        assert self.release.wait(10)


def trace_begins(store: SqliteRunStore) -> list[str]:
    statements: list[str] = []
    conn = store._worker._conn
    conn.set_trace_callback(statements.append)
    return statements


async def queued_behind_gate(store: SqliteRunStore, *writes: object) -> list[object]:
    gate = Gate()
    held = asyncio.ensure_future(store._worker.write(gate))
    assert await asyncio.to_thread(gate.entered.wait, 10)
    tasks = [asyncio.ensure_future(w) for w in writes]  # type: ignore[arg-type]
    await asyncio.sleep(0)  # let every task submit its write to the queue
    gate.release.set()
    await held
    return list(await asyncio.gather(*tasks, return_exceptions=True))


async def test_waiting_writes_share_one_transaction(
    sqlite_store: SqliteRunStore, make_run: MakeRun
) -> None:
    runs = [make_run() for _ in range(10)]
    statements = trace_begins(sqlite_store)
    results = await queued_behind_gate(sqlite_store, *(sqlite_store.create_run(r) for r in runs))
    assert results == runs
    begins = [s for s in statements if s.startswith("BEGIN")]
    commits = [s for s in statements if s == "COMMIT"]
    # one transaction for the gate's batch, one for the ten creates queued behind it
    assert (len(begins), len(commits)) == (2, 2), statements
    for run in runs:
        assert (await sqlite_store.get_run(run.run_id)).run_id == run.run_id


async def test_a_failing_write_in_a_batch_rolls_back_alone(
    sqlite_store: SqliteRunStore, make_run: MakeRun
) -> None:
    existing = await sqlite_store.create_run(make_run())
    fresh = make_run()
    results = await queued_behind_gate(
        sqlite_store,
        sqlite_store.append_event(existing.run_id, "first"),
        sqlite_store.create_run(existing),  # duplicate: refused
        sqlite_store.update_run(existing.run_id, [Eq("version", 1)], Update(set={"error": "a"})),
        sqlite_store.create_run(fresh),
        sqlite_store.append_event(existing.run_id, "second"),
    )
    assert isinstance(results[1], RunAlreadyExists)
    updated = results[2]
    assert isinstance(updated, RunDocument) and updated.version == 2
    assert results[3] == fresh
    events = await sqlite_store.read_events(existing.run_id)
    assert [(e.seq, e.type) for e in events] == [(1, "first"), (2, "second")]
    assert (await sqlite_store.get_run(existing.run_id)).version == 2


async def test_writes_in_one_batch_see_each_other_in_order(
    sqlite_store: SqliteRunStore, make_run: MakeRun
) -> None:
    run = await sqlite_store.create_run(make_run())
    cas = [
        sqlite_store.update_run(run.run_id, [Eq("version", 1)], Update(set={"error": f"n{i}"}))
        for i in range(5)
    ]
    results = await queued_behind_gate(sqlite_store, *cas)
    winners = [r for r in results if isinstance(r, RunDocument)]
    losers = [r for r in results if isinstance(r, CasConflict)]
    assert len(winners) == 1 and len(losers) == 4
    assert all(c.current is not None and c.current.version == 2 for c in losers)


async def test_a_batch_whose_transaction_cannot_start_fails_every_write(
    tmp_path: Path, make_run: MakeRun
) -> None:
    store = await SqliteRunStore.open(tmp_path / "runs.db", busy_timeout_ms=50)
    try:
        run = await store.create_run(make_run())
        blocker = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            results = await asyncio.gather(
                store.append_event(run.run_id, "x"),
                store.create_run(make_run()),
                return_exceptions=True,
            )
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert all(isinstance(r, StoreError) for r in results), results
        assert await store.read_events(run.run_id) == []
    finally:
        await store.close()


async def test_a_closed_store_refuses_with_a_typed_error(tmp_path: Path, make_run: MakeRun) -> None:
    store = await SqliteRunStore.open(tmp_path / "runs.db")
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.create_run(make_run())


async def test_a_write_waits_for_another_processs_lock_and_lands_when_it_frees(
    tmp_path: Path, make_run: MakeRun
) -> None:
    """The worker waits for the write lock itself (SQLite's busy handler is off): a write
    behind another connection's transaction neither fails at once nor is lost."""
    store = await SqliteRunStore.open(tmp_path / "runs.db", busy_timeout_ms=20_000)
    try:
        run = await store.create_run(make_run())
        blocker = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            write = asyncio.ensure_future(store.append_event(run.run_id, "after_the_lock"))
            done, _ = await asyncio.wait({write}, timeout=0.3)
            assert not done, "the write should wait for the lock, not fail"
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        event = await write
        assert event.seq == 1
        assert [e.type for e in await store.read_events(run.run_id)] == ["after_the_lock"]
    finally:
        await store.close()


async def test_an_operation_raising_systemexit_fails_its_batch_and_the_store_keeps_serving(
    sqlite_store: SqliteRunStore, make_run: MakeRun
) -> None:
    def exits(conn: sqlite3.Connection) -> None:
        conn.execute("DELETE FROM runs")  # inside the batch's transaction: must not commit
        raise SystemExit(3)

    run = await sqlite_store.create_run(make_run())
    with pytest.raises(StoreError, match="SystemExit"):
        await sqlite_store._worker.write(exits)
    assert (await sqlite_store.get_run(run.run_id)).run_id == run.run_id
    other = await sqlite_store.create_run(make_run())
    assert (await sqlite_store.get_run(other.run_id)).run_id == other.run_id


class _PausingInFlight(set[asyncio.Future[object]]):
    """The worker's in-flight set, pausing a submit from the thread named `other` between its
    closed check and its queue put (`add` runs between the two), until `resume` is set."""

    def __init__(self, paused: threading.Event, resume: threading.Event) -> None:
        super().__init__()
        self.paused, self.resume = paused, resume

    def add(self, item: asyncio.Future[object]) -> None:
        if threading.current_thread().name == "other":
            self.paused.set()
            self.resume.wait()
        super().add(item)


async def test_a_submit_from_another_thread_that_races_close_fails_typed_instead_of_waiting(
    tmp_path: Path,
) -> None:
    """Found by review: a second thread's read passed the closed check, then `close()` drained
    the queue and the store thread ended before the read was queued. Nobody served it, and its
    caller waited forever. It must hear the typed "closed" error instead."""
    store = await SqliteRunStore.open(tmp_path / "runs.db")
    worker = store._worker
    paused, resume = threading.Event(), threading.Event()
    worker._in_flight = _PausingInFlight(paused, resume)
    outcome: list[object] = []

    def other() -> None:
        async def read() -> None:
            try:
                await asyncio.wait_for(worker.read(lambda c: c.execute("SELECT 1").fetchone()), 5)
                outcome.append("answered")
            except (StoreError, TimeoutError) as exc:
                outcome.append(exc)

        asyncio.run(read())

    thread = threading.Thread(target=other, name="other")
    thread.start()
    await asyncio.to_thread(paused.wait)
    await store.close()  # the store thread drains what is queued and ends
    resume.set()
    await asyncio.to_thread(thread.join)
    assert len(outcome) == 1 and isinstance(outcome[0], StoreError), outcome
    assert "closed" in str(outcome[0])
