"""The SQLite connection under every `SqliteRunStore` operation (ADR-0003, ADR-0009).

Each store instance owns one connection used from one dedicated thread (`SqliteWorker`), and
every operation is a function submitted to that thread in a single hop: the event loop never
blocks on disk. Writes waiting together share one transaction (group commit); none is reported
before its commit. sqlite3 errors become the store's errors here, by result code.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self, TypeVar

from store.sqlite.schema import connect, translate
from store.sqlite_worker import SqliteWorker

T = TypeVar("T")


class SqliteConnection:
    def __init__(self, path: Path, worker: SqliteWorker) -> None:
        self.path = path
        self._worker = worker

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
        return cls(path, worker)

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with _translated(self.path):
            return await self._worker.read(fn)

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` runs inside a write transaction (shared with other writes): no BEGIN/COMMIT."""
        with _translated(self.path):
            return await self._worker.write(fn)

    async def ping(self) -> None:
        await self._read(lambda c: c.execute("SELECT 1").fetchone())

    async def close(self) -> None:
        await self._worker.close()


@contextmanager
def _translated(path: Path) -> Iterator[None]:
    try:
        yield
    except sqlite3.Error as exc:
        raise translate(exc, path) from exc
