"""Point reads on the event loop's own thread (issue 19, ADR-0009 amendment 1): `get_run` runs
on a second connection right where it is awaited, never waiting for a writer; from any other
thread, or when SQLite answers busy, it goes to the store thread as every write does."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from store import Eq, RunStatus, Update
from store.models import RunDocument
from store.sqlite import SqliteRunStore
from tests.store.conftest import MakeRun


class _Counting:
    """The store thread, counting what is handed to it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reads = 0

    async def read(self, fn: Any) -> Any:
        self.reads += 1
        return await self.inner.read(fn)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
async def counted(tmp_path: Path) -> AsyncIterator[tuple[SqliteRunStore, _Counting]]:
    """A real store whose hand-offs to its store thread are counted."""
    store = await SqliteRunStore.open(tmp_path / "runs.db")
    counting = _Counting(store._worker)
    store._worker = counting  # type: ignore[assignment]
    try:
        yield store, counting
    finally:
        await store.close()


async def test_a_point_read_runs_on_the_loop_thread_and_sees_every_committed_write(
    counted: tuple[SqliteRunStore, _Counting], make_run: MakeRun
) -> None:
    store, counting = counted
    run = make_run(status=RunStatus.QUEUED)
    await store.create_run(run)
    written = await store.update_run(
        run.run_id, [Eq("status", RunStatus.QUEUED)], Update(set={"status": "running"})
    )
    assert isinstance(written, RunDocument)
    got = await store.get_run(run.run_id)
    assert (got.status, got.version) == (RunStatus.RUNNING, written.version)
    assert counting.reads == 0  # never handed to the store thread


async def test_a_point_read_from_another_thread_goes_through_the_store_thread(
    counted: tuple[SqliteRunStore, _Counting], make_run: MakeRun
) -> None:
    store, counting = counted
    run = make_run()
    await store.create_run(run)
    seen: list[RunDocument] = []
    other = threading.Thread(target=lambda: seen.append(asyncio.run(store.get_run(run.run_id))))
    other.start()
    await asyncio.to_thread(other.join)
    assert [doc.run_id for doc in seen] == [run.run_id]
    assert counting.reads == 1


class _BusyConnection:
    """A connection whose every statement is answered SQLITE_BUSY (a WAL recovery)."""

    def execute(self, *args: Any) -> Any:
        exc = sqlite3.OperationalError("database is locked")
        exc.sqlite_errorcode = sqlite3.SQLITE_BUSY  # type: ignore[attr-defined]
        raise exc

    def close(self) -> None:
        pass


async def test_a_point_read_answered_busy_is_handed_to_the_store_thread(
    counted: tuple[SqliteRunStore, _Counting], make_run: MakeRun
) -> None:
    store, counting = counted
    real = store._inline
    store._inline = _BusyConnection()  # type: ignore[assignment]
    try:
        run = make_run()
        await store.create_run(run)
        assert (await store.get_run(run.run_id)).run_id == run.run_id
        assert counting.reads == 1
    finally:
        store._inline = real


@pytest.mark.parametrize("closed_twice", [False, True])
async def test_closing_closes_the_inline_connection(tmp_path: Path, closed_twice: bool) -> None:
    store = await SqliteRunStore.open(tmp_path / "runs.db")
    inline = store._inline
    assert inline is not None
    await store.close()
    if closed_twice:
        await store.close()
    with pytest.raises(sqlite3.ProgrammingError):
        inline.execute("SELECT 1")
