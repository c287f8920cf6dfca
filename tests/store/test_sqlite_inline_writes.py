"""Writes on the event loop's own thread while the store thread is idle (issue 19, ADR-0009
amendments 3, 5 and 6): the writes asked for in one turn of the loop share one transaction, begun
and committed on the loop's thread at the end of that turn, each in its own savepoint; while
another connection holds the write lock they wait for it there, and later writes join them; when
the store thread has work, or the lock is held past the patience, they queue there for group
commit."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from store.errors import RunAlreadyExists, RunNotFound, StoreError
from store.protocols import RunQuery
from store.sqlite import SqliteRunStore
from tests.runner.conftest import eventually
from tests.store.conftest import MakeRun
from tests.store.test_sqlite_group_commit import Gate


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteRunStore]:
    opened = await SqliteRunStore.open(tmp_path / "runs.db", busy_timeout_ms=20_000)
    yield opened
    await opened.close()


def traced(conn: sqlite3.Connection | None) -> list[str]:
    assert conn is not None
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    return statements


def inserts(statements: list[str]) -> list[str]:
    return [s for s in statements if s.startswith("INSERT INTO runs")]


async def test_a_write_while_the_store_thread_is_idle_commits_on_the_loop_thread(
    store: SqliteRunStore, make_run: MakeRun
) -> None:
    here, there = traced(store._inline), traced(store._worker._conn)
    run = make_run()
    assert await store.create_run(run) == run
    assert len(inserts(here)) == 1 and here[0] == "BEGIN IMMEDIATE" and here[-1] == "COMMIT"
    assert inserts(there) == []
    assert (await store.get_run(run.run_id)).run_id == run.run_id


async def test_a_write_while_the_store_thread_is_busy_queues_for_group_commit(
    store: SqliteRunStore, make_run: MakeRun
) -> None:
    here, there = traced(store._inline), traced(store._worker._conn)
    gate = Gate()
    held = asyncio.ensure_future(store._worker.write(gate))
    assert await asyncio.to_thread(gate.entered.wait, 10)
    runs = [make_run() for _ in range(3)]
    writes = [asyncio.ensure_future(store.create_run(r)) for r in runs]
    await asyncio.sleep(0)  # every write is submitted behind the gate
    gate.release.set()
    await held
    assert await asyncio.gather(*writes) == runs
    assert inserts(here) == []
    assert len(inserts(there)) == 3
    assert len([s for s in there if s == "COMMIT"]) == 2  # the gate's batch, then the three


async def test_a_write_that_finds_the_lock_taken_waits_for_it_on_the_loop_thread_and_lands(
    store: SqliteRunStore, make_run: MakeRun, tmp_path: Path
) -> None:
    """Amendment 6: the turn tries again on the loop's thread while another process holds the
    lock, and a write asked for meanwhile joins it: one transaction, nothing on the thread."""
    store.lock_patience_s = 60.0  # the test releases the lock, not the patience
    here, there = traced(store._inline), traced(store._worker._conn)
    blocker = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    first, second = make_run(), make_run()
    try:
        write = asyncio.ensure_future(store.create_run(first))
        tries = 3 + 2  # `_begin`'s three, then two tries of later turns
        await eventually(lambda: _at_least(here.count("BEGIN IMMEDIATE"), tries), within=10)
        assert not write.done(), "the write should wait for the lock, not fail"
        late = asyncio.ensure_future(store.create_run(second))
        await eventually(lambda: _at_least(here.count("BEGIN IMMEDIATE"), tries + 1), within=10)
        assert inserts(here) == []
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert await write == first and await late == second
    assert len(inserts(here)) == 2 and here.count("COMMIT") == 1  # together
    assert inserts(there) == []
    assert (await store.get_run(second.run_id)).run_id == second.run_id


async def _at_least(value: int, least: int) -> bool:
    return value >= least


async def test_a_write_cancelled_while_it_waits_for_the_lock_is_never_run(
    store: SqliteRunStore, make_run: MakeRun, tmp_path: Path
) -> None:
    """Cancelled while its turn waits for the lock: never run, and the wait ends with it (the
    next write that finds the lock taken waits its own full patience)."""
    store.lock_patience_s = 60.0
    here = traced(store._inline)
    blocker = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    gone, kept = make_run(), make_run()
    try:
        write = asyncio.ensure_future(store.create_run(gone))
        await eventually(lambda: _at_least(here.count("BEGIN IMMEDIATE"), 4), within=10)
        write.cancel()
        await eventually(lambda: _done_waiting(store), within=10)
        assert store._busy_since is None
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert await store.create_run(kept) == kept
    assert len(inserts(here)) == 1
    with pytest.raises(RunNotFound):
        await store.get_run(gone.run_id)


async def _done_waiting(store: SqliteRunStore) -> bool:
    return not store._turn_scheduled


async def test_a_write_that_finds_the_lock_taken_past_its_patience_goes_to_the_store_thread(
    store: SqliteRunStore, make_run: MakeRun, tmp_path: Path
) -> None:
    """A lock held past `lock_patience_s` is not one transaction's: the store thread takes the
    write over and waits for the lock with the busy timeout."""
    store.lock_patience_s = 0.0
    here, there = traced(store._inline), traced(store._worker._conn)
    blocker = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    run = make_run()
    try:
        write = asyncio.ensure_future(store.create_run(run))
        await eventually(lambda: _at_least(there.count("BEGIN IMMEDIATE"), 1), within=10)
        assert not write.done(), "the write should wait for the lock, not fail"
        assert here == ["BEGIN IMMEDIATE"] * 3  # `_begin`'s tries here; nothing ran
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert await write == run
    assert len(inserts(there)) == 1 and inserts(here) == []
    assert (await store.get_run(run.run_id)).run_id == run.run_id


async def test_a_write_that_raises_on_the_loop_thread_rolls_back_and_raises_its_typed_error(
    store: SqliteRunStore, make_run: MakeRun
) -> None:
    here = traced(store._inline)
    run = make_run()
    await store.create_run(run)
    here.clear()
    with pytest.raises(RunAlreadyExists):
        await store.create_run(run)
    assert here[0] == "BEGIN IMMEDIATE" and "ROLLBACK TO op" in here and here[-1] == "COMMIT"
    assert store._inline is not None and not store._inline.in_transaction
    other = make_run()
    assert await store.create_run(other) == other  # the store goes on


async def test_a_write_from_another_thread_goes_through_the_store_thread(
    store: SqliteRunStore, make_run: MakeRun
) -> None:
    here, there = traced(store._inline), traced(store._worker._conn)
    run = make_run()
    assert await asyncio.to_thread(asyncio.run, store.create_run(run)) == run
    assert inserts(here) == []
    assert len(inserts(there)) == 1


async def test_the_writes_asked_for_in_one_turn_of_the_loop_share_one_transaction(
    store: SqliteRunStore, make_run: MakeRun
) -> None:
    here, there = traced(store._inline), traced(store._worker._conn)
    runs = [make_run() for _ in range(4)]
    assert await asyncio.gather(*(store.create_run(r) for r in runs)) == runs
    assert len(inserts(here)) == 4 and inserts(there) == []
    assert here.count("BEGIN IMMEDIATE") == 1 and here.count("COMMIT") == 1
    assert here.count("SAVEPOINT op") == 4
    for run in runs:
        assert (await store.get_run(run.run_id)).run_id == run.run_id


async def test_a_write_that_raises_in_a_shared_turn_is_rolled_back_alone(
    store: SqliteRunStore, make_run: MakeRun
) -> None:
    taken = make_run()
    await store.create_run(taken)
    here = traced(store._inline)
    fresh = [make_run(), make_run()]
    answers = await asyncio.gather(
        store.create_run(fresh[0]),
        store.create_run(taken),  # a duplicate: raises, rolled back to its savepoint
        store.create_run(fresh[1]),
        return_exceptions=True,
    )
    assert answers[0] == fresh[0] and answers[2] == fresh[1]
    assert isinstance(answers[1], RunAlreadyExists)
    assert here.count("BEGIN IMMEDIATE") == 1 and here.count("ROLLBACK TO op") == 1
    assert here[-1] == "COMMIT"
    for run in fresh:
        assert (await store.get_run(run.run_id)).run_id == run.run_id


async def test_a_write_cancelled_before_its_turn_ends_is_never_run(
    store: SqliteRunStore, make_run: MakeRun
) -> None:
    here = traced(store._inline)
    kept, dropped = make_run(), make_run()
    keep = asyncio.ensure_future(store.create_run(kept))
    drop = asyncio.ensure_future(store.create_run(dropped))
    await asyncio.sleep(0)  # both asked for in this turn; the commit is at its end
    drop.cancel()
    assert await keep == kept
    with pytest.raises(asyncio.CancelledError):
        await drop
    assert len(inserts(here)) == 1
    assert [r.run_id for r in (await store.list_runs(RunQuery())).runs] == [kept.run_id]


class _Escapes(BaseException):
    """Not an `Exception`: what `commit_begun` does not catch write by write."""


async def test_a_turn_whose_write_raises_a_base_exception_fails_every_write_of_it(
    store: SqliteRunStore, make_run: MakeRun
) -> None:
    def escapes(conn: sqlite3.Connection) -> None:
        raise _Escapes()

    kept = make_run()
    loop = asyncio.get_running_loop()
    seen: list[BaseException] = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx["exception"]))
    try:
        answers = await asyncio.gather(
            store.create_run(kept), store._write(escapes), return_exceptions=True
        )
    finally:
        loop.set_exception_handler(None)
    # Neither caller waits forever; nothing of the turn is committed; the loop heard why.
    assert all(isinstance(a, StoreError) for a in answers), answers
    assert [type(e) for e in seen] == [_Escapes]
    assert store._inline is not None and not store._inline.in_transaction
    assert (await store.list_runs(RunQuery())).runs == []
    assert await store.create_run(kept) == kept  # the store goes on
