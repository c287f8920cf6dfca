"""The SQLite connection under every `SqliteRunStore` operation (ADR-0003, ADR-0009).

Each store instance owns one connection used from one dedicated thread (`SqliteWorker`), where
writes waiting together share one transaction (group commit), and a second connection used on the
event loop's own thread for what is cheaper there than a hop: point reads, and a write while the
store thread is idle and the write lock free. None is reported before its commit. sqlite3 errors
become the store's errors here, by result code.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Self, TypeVar

from store.sqlite.checkpointer import WalCheckpointer
from store.sqlite.schema import connect, translate
from store.sqlite_worker import SqliteWorker

T = TypeVar("T")


class SqliteConnection:
    def __init__(
        self,
        path: Path,
        worker: SqliteWorker,
        inline: sqlite3.Connection | None = None,
        checkpointer: WalCheckpointer | None = None,
    ) -> None:
        self.path = path
        self._worker = worker
        self._inline = inline
        self._inline_thread = threading.get_ident()
        self.checkpointer = checkpointer

    @classmethod
    async def open(cls, path: Path | str, *, busy_timeout_ms: int = 10_000) -> Self:
        """Open (creating if needed) the store file. A file that is not a SQLite database is a
        `StoreCorrupt` naming it; it is never overwritten."""
        path = Path(path)
        with _translated(path):
            worker = await SqliteWorker.start(
                lambda: connect(path, busy_timeout_ms),
                f"sqlite-{path.name}",
                busy_timeout_s=busy_timeout_ms / 1000,
            )
            inline = await asyncio.to_thread(connect, path, busy_timeout_ms)
            inline.execute("PRAGMA busy_timeout = 0")  # busy: hand the work to the thread
        checkpointer = WalCheckpointer(
            lambda: connect(path, busy_timeout_ms), f"sqlite-checkpoint-{path.name}"
        )
        return cls(path, worker, inline, checkpointer)

    def _here(self) -> sqlite3.Connection | None:
        """The inline connection, on the thread that opened the store (its event loop's)."""
        if self._inline is None or threading.get_ident() != self._inline_thread:
            return None
        return self._inline

    async def _point_read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """A read of a row or two by key, run right here on the event loop's thread: a hop to
        the store thread and back cost ≈ 100 µs of CPU on these machines, more than the read
        (issue 19; ADR-0009 amendment). WAL readers never wait for writers; a busy answer (a
        WAL recovery) goes to the thread, which waits."""
        conn = self._here()
        if conn is not None:
            with _translated(self.path):
                try:
                    return fn(conn)
                except sqlite3.OperationalError as exc:
                    if not _busy(exc):
                        raise
        return await self._read(fn)

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with _translated(self.path):
            return await self._worker.read(fn)

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` runs inside a write transaction: no BEGIN/COMMIT of its own.

        When the store thread is idle, the write would be a batch of one there: it runs
        right here instead, its own transaction, if the write lock is free at once (a hop to
        the thread and back was most of a lone write's latency, issue 19). Once a write finds
        the lock taken, it goes to the thread, which waits for the lock; every write after it
        queues there while it waits, and they commit together (ADR-0009 amendment 3). An
        earlier attempt ran *every* write here and lost group commit under load: drain fell
        from 849 to 665 runs/s (docs/performance.md)."""
        conn = self._here()
        if conn is not None and self._worker.idle:
            with _translated(self.path):
                ran, result = _write_at_once(conn, fn)
            if ran:
                return result  # type: ignore[return-value]
        with _translated(self.path):
            return await self._worker.write(fn)

    async def ping(self) -> None:
        await self._read(lambda c: c.execute("SELECT 1").fetchone())

    async def close(self) -> None:
        if self.checkpointer is not None:
            await asyncio.to_thread(self.checkpointer.close)
            self.checkpointer = None
        await self._worker.close()
        if self._inline is not None:
            self._inline.close()
            self._inline = None


def _write_at_once(
    conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]
) -> tuple[bool, T | None]:
    """`(True, fn's result)` after its transaction committed; `(False, None)` when another
    connection holds the write lock (nothing ran). `fn`'s error rolls it back and propagates."""
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if _busy(exc):
            return False, None
        raise
    try:
        result = fn(conn)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise
    return True, result


def _busy(exc: sqlite3.OperationalError) -> bool:
    return getattr(exc, "sqlite_errorcode", 0) & 0xFF in (
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
    )


@contextmanager
def _translated(path: Path) -> Iterator[None]:
    try:
        yield
    except sqlite3.Error as exc:
        raise translate(exc, path) from exc
