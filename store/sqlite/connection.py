"""The SQLite connection under every `SqliteRunStore` operation (ADR-0003, ADR-0009).

Each store instance owns one connection used from one dedicated thread (`SqliteWorker`), where
writes waiting together share one transaction (group commit), and a second connection used on the
event loop's own thread for what is cheaper there than a hop: point reads, and the writes of one
turn of the loop, together in one transaction, while the store thread is idle and the write lock
free. None is reported before its commit. sqlite3 errors become the store's errors here, by
result code.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Self, TypeVar

from store.errors import StoreError
from store.sqlite.checkpointer import WalCheckpointer
from store.sqlite.schema import connect, translate
from store.sqlite_worker import SqliteWorker, commit_begun

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
        self._turn: list[tuple[Callable[[sqlite3.Connection], Any], asyncio.Future[Any]]] = []
        """The writes asked for in this turn of the loop, committed together at its end."""
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

        When the store thread is idle, the write runs right here on the event loop's thread
        (a hop to the thread and back was most of a lone write's latency, issue 19), though not
        at once: every write asked for in one turn of the loop shares one transaction, begun
        and committed at the end of that turn (`_commit_turn`). A BEGIN and a COMMIT cost about
        as much CPU as the write between them, and the slots of a runner that took one fetch
        batch claim, and later finish, in the same turns (ADR-0009 amendment 5).

        If the write lock is taken, the turn's writes go to the store thread, which waits for
        the lock; every write after them queues there while it waits, and they commit together
        (amendment 3). An earlier attempt ran every write here in its own transaction and lost
        group commit under load: drain fell from 849 to 665 runs/s (docs/performance.md)."""
        conn = self._here()
        if conn is not None and self._worker.idle:
            loop = asyncio.get_running_loop()
            turn: asyncio.Future[Any] = loop.create_future()
            self._turn.append((fn, turn))
            if len(self._turn) == 1:
                loop.call_soon(self._commit_turn)
            with _translated(self.path):
                result = await turn
            if result is not _LOCK_TAKEN:
                return result  # type: ignore[no-any-return]
        with _translated(self.path):
            return await self._worker.write(fn)

    def _commit_turn(self) -> None:
        """This turn's writes in one transaction on the inline connection; each one's future
        gets its result, or `_LOCK_TAKEN` when another process holds the write lock (the
        caller then hands its write to the store thread)."""
        waiting, self._turn = [(fn, f) for fn, f in self._turn if not f.cancelled()], []
        conn = self._here()
        if not waiting:
            return
        lock_taken = [(True, _LOCK_TAKEN)] * len(waiting)
        if conn is None:  # closed since: the thread says so
            _settle_turn(waiting, lock_taken)
            return
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            if isinstance(exc, sqlite3.OperationalError) and _busy(exc):
                _settle_turn(waiting, lock_taken)
            else:
                _settle_turn(waiting, [(False, exc)] * len(waiting))
            return
        try:
            outcomes = commit_begun(conn, [fn for fn, _ in waiting])
        except BaseException as exc:
            # Only something like `KeyboardInterrupt` raised by a write gets here: nothing of
            # the turn is committed, and no caller may wait forever (as on the store thread).
            if conn.in_transaction:
                with suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            failure = StoreError(f"the store operation failed: {exc!r}")
            _settle_turn(waiting, [(False, failure)] * len(waiting))
            raise
        _settle_turn(waiting, outcomes)

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


_LOCK_TAKEN = object()
"""A turn's answer to a write it did not run: another connection held the write lock."""


def _settle_turn(
    waiting: list[tuple[Callable[[sqlite3.Connection], Any], asyncio.Future[Any]]],
    outcomes: list[tuple[bool, Any]],
) -> None:
    for (_, future), (ok, value) in zip(waiting, outcomes, strict=True):
        if future.done():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


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
