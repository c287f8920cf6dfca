"""Events on SQLite (SPEC §6.3): `max(seq) + 1` inside the write transaction."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from datetime import datetime

from store.codec import decode, encode
from store.events import AppendsDrafts
from store.models import Event
from store.protocols import EventDraft
from store.sqlite.connection import SqliteConnection
from store.sqlite.schema import dumps, loads


def append(conn: sqlite3.Connection, run_id: str, draft: EventDraft, at: datetime) -> Event:
    """Append inside the caller's write transaction. The transaction (IMMEDIATE) serialises
    appenders across processes, so max(seq)+1 cannot collide; the primary key would refuse a
    duplicate if it did."""
    (last,) = conn.execute(
        "SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_id = ?", (run_id,)
    ).fetchone()
    event = draft.event(run_id, last + 1, at)
    conn.execute(
        "INSERT INTO events (run_id, seq, doc) VALUES (?, ?, ?)",
        (run_id, event.seq, dumps(encode(event))),
    )
    return event


def append_drafts(
    conn: sqlite3.Connection, run_id: str, drafts: Sequence[EventDraft], at_ms: int
) -> None:
    """Append several events inside the caller's write transaction (see `append`). The rows are
    built as storage-form dicts directly: the drafts come from the product's own code, and the
    `Event` model's validation and dump were a tenth of a run's store CPU
    (docs/performance.md, issue 19)."""
    if not drafts:
        return
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
        return [
            decode(Event, loads(d, "event", f"{run_id}#{s}"), what="event", ident=f"{run_id}#{s}")
            for s, d in rows
        ]
