"""Events on SQLite (SPEC §6.3): `max(seq) + 1` inside the write transaction."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from datetime import datetime

from store.codec import decode
from store.events import AppendsDrafts
from store.models import Event
from store.protocols import EventDraft
from store.sqlite.connection import SqliteConnection
from store.sqlite.schema import dumps, loads
from store.timeutil import to_ms


def append(conn: sqlite3.Connection, run_id: str, draft: EventDraft, at: datetime) -> Event:
    """Append one event inside the caller's write transaction, as the model it stored. The
    model is built after the insert: an event that does not validate raises, and the caller's
    transaction (or savepoint) takes the row back."""
    return draft.event(run_id, append_drafts(conn, run_id, [draft], to_ms(at)), at)


def append_drafts(
    conn: sqlite3.Connection, run_id: str, drafts: Sequence[EventDraft], at_ms: int
) -> int:
    """Append events inside the caller's write transaction; returns the last `seq`. The
    transaction (IMMEDIATE) serialises appenders across processes, so `max(seq)+1` cannot
    collide; the primary key would refuse a duplicate if it did. The rows are
    built as storage-form dicts directly: the drafts come from the product's own code, and the
    `Event` model's validation and dump were a tenth of a run's store CPU
    (docs/performance.md, issue 19)."""
    if not drafts:
        return 0  # no query: most writes carry no event
    (last,) = conn.execute(
        "SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_id = ?", (run_id,)
    ).fetchone()
    conn.executemany(
        "INSERT INTO events (run_id, seq, doc) VALUES (?, ?, ?)",
        [
            (run_id, last + i, dumps(draft.stored(run_id, last + i, at_ms)))
            for i, draft in enumerate(drafts, start=1)
        ],
    )
    return int(last) + len(drafts)


class SqliteEvents(AppendsDrafts, SqliteConnection):
    async def _append_draft(self, run_id: str, draft: EventDraft, at: datetime) -> Event:
        return await self._write(lambda conn: append(conn, run_id, draft, at))

    async def read_events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]:
        rows = await self._read(
            lambda c: c.execute(
                "SELECT seq, doc FROM events WHERE run_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (run_id, after_seq, limit),
            ).fetchall()
        )
        return _decoded(run_id, rows)

    async def read_events_before(
        self, run_id: str, before_seq: int | None = None, limit: int = 1000
    ) -> list[Event]:
        before = _NO_SEQ_ABOVE if before_seq is None else before_seq
        rows = await self._read(
            lambda c: c.execute(
                "SELECT seq, doc FROM events WHERE run_id = ? AND seq < ?"
                " ORDER BY seq DESC LIMIT ?",
                (run_id, before, limit),
            ).fetchall()
        )
        return _decoded(run_id, rows)


_NO_SEQ_ABOVE = 2**62
"""Above every seq a run can reach (SQLite's integers are 64-bit)."""


def _decoded(run_id: str, rows: list[tuple[int, str]]) -> list[Event]:
    return [
        decode(Event, loads(d, "event", f"{run_id}#{s}"), what="event", ident=f"{run_id}#{s}")
        for s, d in rows
    ]
