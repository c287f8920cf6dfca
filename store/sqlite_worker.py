"""The thread that owns a SQLite connection, with group commit (ADR-0009; docs/performance.md).

Every `SqliteRunStore` operation is a function of the connection, handed to this one thread.
The thread takes everything that is waiting at once: the writes run one after another inside a
single `BEGIN IMMEDIATE … COMMIT`, each in its own savepoint, and the reads run after it. So:

- each write still sees the writes queued before it (they run in order, in one transaction), and
  a write that raises (a duplicate `create_run`, an invalid document) is rolled back to its
  savepoint alone; the others commit;
- no caller hears of a write before the transaction holding it has committed; if the commit
  fails, every write in it fails with that error and none of them happened;
- under load, one transaction and one lock handoff carry many writes (one per busy slot), which
  is what bounded the store: a commit's fixed cost and the cross-process lock wait are paid once
  per batch, not once per write. With one write waiting it is the plain transaction it was.

The results of a batch go back to the event loop in one `call_soon_threadsafe`.

Waiting for another process's write lock is done here, not by SQLite's busy handler: that one
sleeps 1, 2, 5, 10 … 100 ms between tries and is not woken when the lock frees, so a writer
waited far longer than the lock was held (docs/performance.md, "SQLite between processes").
This thread polls every 0.1 to 1 ms instead, up to the same busy timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from store.errors import StoreError

T = TypeVar("T")
Work = Callable[[sqlite3.Connection], Any]

log = logging.getLogger(__name__)

MAX_BATCH = 128
"""Most operations taken from the queue at once; bounds how long one transaction holds the
write lock against other processes."""


@dataclass(slots=True)
class _Op:
    fn: Work
    writes: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    outcome: tuple[bool, Any] = field(default=(False, None))


class _Stop:
    pass


class SqliteWorker:
    """One connection, one thread, group commit for writes."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        name: str,
        *,
        busy_timeout_s: float = 10.0,
        max_batch: int = MAX_BATCH,
    ):
        self._conn = conn
        self._busy_timeout_s = busy_timeout_s
        conn.execute("PRAGMA busy_timeout = 0")  # `_patiently` waits instead
        self._queue: queue.SimpleQueue[_Op | _Stop] = queue.SimpleQueue()
        self._max_batch = max_batch
        self._closed = False
        self._in_flight: set[asyncio.Future[Any]] = set()
        """Submitted and not yet settled. A set, not a counter: `add` and `discard` are each one
        step under the GIL, so a store used from a second thread's loop cannot skew it."""
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @classmethod
    async def start(
        cls, connect: Callable[[], sqlite3.Connection], name: str, *, busy_timeout_s: float
    ) -> SqliteWorker:
        """Connect on a fresh thread (opening a file is blocking I/O), then serve on it."""
        conn = await asyncio.to_thread(connect)
        return cls(conn, name, busy_timeout_s=busy_timeout_s)

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn` outside any transaction (a read sees the last commit)."""
        result: T = await self._submit(fn, writes=False)
        return result

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn` inside a write transaction it may share with other writes; it must not
        begin, commit or roll back itself."""
        result: T = await self._submit(fn, writes=True)
        return result

    def _submit(self, fn: Work, *, writes: bool) -> asyncio.Future[Any]:
        if self._closed:
            raise StoreError("the SQLite store is closed")
        loop = asyncio.get_running_loop()
        op = _Op(fn, writes, loop, loop.create_future())
        self._in_flight.add(op.future)
        op.future.add_done_callback(self._in_flight.discard)
        self._queue.put(op)
        if self._closed:
            # `close()` ran between the check above and the put: only possible from another
            # thread's loop. The store thread may have drained the queue and ended before the
            # put; once it has ended, what is left fails here, so no caller waits forever.
            self._thread.join()
            self._drain_after_stop()
        return op.future

    @property
    def idle(self) -> bool:
        """Nothing submitted is waiting or running on the thread: a write now would be a batch
        of one."""
        return not self._in_flight

    async def close(self) -> None:
        """Finish what is queued, close the connection, and end the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_Stop())
        await asyncio.to_thread(self._thread.join)

    # -- the thread ---------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self._max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            ops = [op for op in batch if isinstance(op, _Op) and not op.future.cancelled()]
            try:
                self._run_batch(ops)
            except BaseException as exc:  # a caller must never wait forever
                # Only something like `SystemExit` raised by an operation gets here: fail the
                # whole batch (its transaction, if any, was not committed) and keep serving.
                log.exception("the SQLite store thread caught %r; its batch failed", exc)
                if self._conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._conn.execute("ROLLBACK")
                failure = StoreError(f"the store operation failed: {exc!r}")
                for op in ops:
                    op.outcome = (False, failure)
            self._deliver(ops)
            if any(isinstance(op, _Stop) for op in batch):
                self._drain_after_stop()
                self._conn.close()
                return

    def _run_batch(self, ops: list[_Op]) -> None:
        writes = [op for op in ops if op.writes]
        if writes:
            self._commit(writes)
        for op in ops:
            if not op.writes:
                op.outcome = self._attempt(functools.partial(self._patiently, op.fn))

    def _attempt(self, fn: Work) -> tuple[bool, Any]:
        """`(True, fn(conn))`, or `(False, the exception)` for the awaiting caller."""
        try:
            return True, fn(self._conn)
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
            return False, exc

    def _patiently(self, fn: Work, conn: sqlite3.Connection) -> Any:
        """`fn(conn)`, retried while another process holds a lock SQLite reports as busy."""
        deadline = time.monotonic() + self._busy_timeout_s
        pause = 0.0001
        while True:
            try:
                return fn(conn)
            except sqlite3.OperationalError as exc:
                busy = getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_BUSY
                if not busy or time.monotonic() >= deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.001)

    def _commit(self, writes: list[_Op]) -> None:
        try:
            self._patiently(lambda c: c.execute("BEGIN IMMEDIATE"), self._conn)
        except sqlite3.Error as exc:
            for op in writes:
                op.outcome = (False, exc)
            return
        outcomes = commit_begun(self._conn, [op.fn for op in writes])
        for op, outcome in zip(writes, outcomes, strict=True):
            op.outcome = outcome

    def _deliver(self, ops: list[_Op]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[_Op]] = {}
        for op in ops:
            by_loop.setdefault(op.loop, []).append(op)
        for loop, settled in by_loop.items():
            # A closed loop raises RuntimeError: nobody is waiting there any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, settled)

    def _drain_after_stop(self) -> None:
        late: list[_Op] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Op):
                item.outcome = (False, StoreError("the SQLite store is closed"))
                late.append(item)
        self._deliver(late)


def commit_begun(conn: sqlite3.Connection, writes: list[Work]) -> list[tuple[bool, Any]]:
    """Run `writes` in the transaction just begun on `conn`, each in its own savepoint, and
    commit: each one's `(True, result)` or `(False, its exception)`. A write that raises is
    rolled back alone; if SQLite rolls the whole transaction back, or the commit fails, every
    write fails with that error and none of them happened."""
    outcomes: list[tuple[bool, Any]] = []
    try:
        for fn in writes:
            conn.execute("SAVEPOINT op")
            try:
                outcome: tuple[bool, Any] = (True, fn(conn))
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
                outcome = (False, exc)
            outcomes.append(outcome)
            if not conn.in_transaction:
                # SQLite rolled the whole transaction back (disk full, I/O error): nothing
                # in this batch happened.
                ok, value = outcome
                raise value if not ok else StoreError("the transaction was rolled back")
            if not outcome[0]:
                conn.execute("ROLLBACK TO op")
            conn.execute("RELEASE op")
        conn.execute("COMMIT")
    except Exception as exc:  # noqa: BLE001 - every write in the batch fails with it
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                log.exception("rollback after a failed batch failed")
        return [(False, exc)] * len(writes)
    return outcomes


def _settle(ops: list[_Op]) -> None:
    for op in ops:
        if op.future.done():
            continue
        ok, value = op.outcome
        if ok:
            op.future.set_result(value)
        else:
            op.future.set_exception(value)
