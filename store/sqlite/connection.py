"""The SQLite connection under every `SqliteRunStore` operation (ADR-0003, ADR-0009).

Each store instance owns one connection used from one dedicated thread (`SqliteWorker`), where
writes waiting together share one transaction (group commit), and a second connection used on the
event loop's own thread for what is cheaper there than a hop: point reads, and the writes of one
turn of the loop, together in one transaction, while the store thread is idle (waiting briefly
for the write lock when another process holds it). None is reported before its commit. sqlite3
errors become the store's errors here, by result code.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
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
        self._turn_scheduled = False
        self._busy_since: float | None = None
        """When the pending turn first found the write lock taken (loop time)."""
        self.lock_patience_s = LOCK_PATIENCE_S
        """How long writes wait for the lock on the loop's thread before the store thread
        takes them over."""
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

        If another process holds the write lock, the turn waits for it here (amendment 6):
        `_begin` tries twice more after a 50 µs pause, then the turn is tried again at later
        turns of the loop, and every write asked for meanwhile joins it. Only after
        `lock_patience_s` do its writes go to the store thread, which waits for the lock with
        the busy timeout; every write after them queues there, and they commit together
        (amendment 3). An earlier attempt ran every write here in its own transaction and lost
        group commit under load: drain fell from 849 to 665 runs/s (docs/performance.md)."""
        conn = self._here()
        if conn is not None and self._worker.idle:
            loop = asyncio.get_running_loop()
            turn: asyncio.Future[Any] = loop.create_future()
            self._turn.append((fn, turn))
            if not self._turn_scheduled:
                self._turn_scheduled = True
                loop.call_soon(self._commit_turn)
            with _translated(self.path):
                result = await turn
            if result is not _LOCK_TAKEN:
                return result  # type: ignore[no-any-return]
        with _translated(self.path):
            return await self._worker.write(fn)

    def _commit_turn(self) -> None:
        """The pending writes in one transaction on the inline connection; each one's future
        gets its result. While another process holds the write lock the writes stay pending
        and this runs again shortly; past `lock_patience_s` each future gets `_LOCK_TAKEN`
        (the caller then hands its write to the store thread)."""
        self._turn_scheduled = False
        waiting, self._turn = [(fn, f) for fn, f in self._turn if not f.cancelled()], []
        conn = self._here()
        if not waiting:
            self._busy_since = None  # every waiting write was cancelled: the wait is over
            return
        lock_taken = [(True, _LOCK_TAKEN)] * len(waiting)
        if conn is None:  # closed since: the thread says so
            _settle_turn(waiting, lock_taken)
            return
        try:
            _begin(conn)
        except sqlite3.Error as exc:
            if isinstance(exc, sqlite3.OperationalError) and _busy(exc):
                loop = asyncio.get_running_loop()
                if self._busy_since is None:
                    self._busy_since = loop.time()
                if loop.time() - self._busy_since < self.lock_patience_s:
                    self._turn = waiting + self._turn  # later writes join these
                    self._turn_scheduled = True
                    loop.call_later(_RETRY_S, self._commit_turn)
                    return
                self._busy_since = None
                _settle_turn(waiting, lock_taken)
            else:
                _settle_turn(waiting, [(False, exc)] * len(waiting))
            return
        self._busy_since = None
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


def _begin(conn: sqlite3.Connection) -> None:
    """`BEGIN IMMEDIATE`, tried twice more after a pause of `_SPIN_S` while another process
    holds the write lock: it holds it for one transaction, ≈ 0.1-0.3 ms here, so a short wait
    on the spot usually gets it, where the loop's next try comes a millisecond later at best
    and a hop to the store thread costs ≈ 0.1 ms of CPU and a GIL hand-over each way."""
    for _ in range(_SPINS):
        try:
            conn.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as exc:
            if not _busy(exc):
                raise
        time.sleep(_SPIN_S)
    conn.execute("BEGIN IMMEDIATE")


_SPINS = 2
_SPIN_S = 0.00005
_RETRY_S = 0.0005
"""Between a turn's tries for the lock on the loop's thread: asyncio's epoll wait rounds up to
the millisecond, so ≈ 1 ms unless the loop has other work sooner."""
LOCK_PATIENCE_S = 0.05
"""How long a turn's writes wait for the lock on the loop's thread before the store thread,
which waits with the busy timeout, takes them over: a lock held this long is not one
transaction's (a long operator query, a WAL truncation), and polling it here would cost CPU."""

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
