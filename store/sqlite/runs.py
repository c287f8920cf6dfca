"""`SqliteRunStore`: the embedded default `RunStore` (SPEC §9, ADR-0003). This module holds the
run documents and their compare-and-set; events, records (interactions, staged uploads, locks),
the connection and the schema are its sibling modules.

One file in WAL mode, shared by several processes (`runfleet up` runs N runner processes on it).
A compare-and-set is `SELECT; UPDATE` inside a `BEGIN IMMEDIATE` transaction with no await in
between, so it is atomic against other tasks *and* other processes (IMMEDIATE takes the write
lock first).
"""

from __future__ import annotations

import json
import sqlite3
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from store.cas import (
    CasConflict,
    Condition,
    LeaseRefresh,
    NarrowWrite,
    Update,
    apply_update,
    check_update,
    matches,
    narrow_write,
)
from store.codec import decode, encode
from store.errors import DocumentInvalid, RunAlreadyExists, RunfleetError, RunNotFound
from store.models import RunDocument, RunStatus
from store.protocols import EventDraft, RunCopy, RunCopyPage, RunPage, RunQuery, Unreadable
from store.sqlite.events import SqliteEvents, append_drafts
from store.sqlite.records import SqliteRecords
from store.sqlite.schema import (
    changed_columns,
    column_value,
    dumps,
    json_field,
    loads,
    run_columns,
)
from store.timeutil import to_ms, utcnow


def _run(text: str, run_id: str) -> RunDocument:
    """A stored run as its model, parsed and validated in one pass by pydantic's own JSON
    reader: half the CPU of `json.loads` and then validating the dict (issue 19; it reads
    NaN, infinities and ints past 64 bits as `json` does). Text it does not read (a lone
    surrogate escape, which `json` accepts, or text that is not JSON) and any document that
    fails validation take the `json` path, which says what is wrong as it always did."""
    try:
        return RunDocument.model_validate_json(text)
    except ValidationError:
        return decode(RunDocument, loads(text, "run", run_id), what="run", ident=run_id)


def _copy(run_id: str, status: str, failure_code: str | None, fields: str | None) -> RunCopy:
    """A `RunCopy` from the query columns and the three fields as a JSON array (None: a
    document that is not JSON at all). An `attempt` that is not an integer reads as 0: no
    publication matches it, so the sweeper reads the run, meets its error and passes on
    (found by review: `int(None)` raised out of the page and stopped the pass)."""
    if fields is None:
        return RunCopy(run_id, 0, None, None, status, failure_code)
    attempt, published, seq = json.loads(fields)
    return RunCopy(run_id, _attempt(attempt), published, seq, status, failure_code)


def _attempt(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


@dataclass(frozen=True, slots=True)
class _Judged:
    """A compare-and-set that matched: the answer, the UPDATE's arguments, the write's instant
    and text."""

    doc: RunDocument
    args: tuple[Any, ...]
    now_ms: int
    text: str
    """The document as written: what the row holds once the write lands."""


def _select_doc(conn: sqlite3.Connection, run_id: str) -> tuple[str] | None:
    row: tuple[str] | None = conn.execute(
        "SELECT doc FROM runs WHERE run_id = ?", (run_id,)
    ).fetchone()
    return row


def _text(row: tuple[str] | None) -> str | None:
    return None if row is None else row[0]


_REFRESH = (
    "UPDATE runs SET doc = json_set(doc, '$.lease.expires_at', ?), lease_expires_ms = ?"
    " WHERE run_id = ? AND json_valid(doc) AND json_extract(doc, '$.lease.token') = ?"
    " RETURNING doc"
)
"""A lease refresh in place: SQLite's JSON functions (C) set the one field in the stored text,
which keeps every other byte of it (numbers, escapes) as written. `json_valid` leaves alone a
text they would rewrite: one holding a NaN or an infinity, which Python's `json` writes as
`NaN`/`Infinity` and which a newer SQLite would turn into `null`."""

_RECORD_PUBLICATION = (
    "UPDATE runs SET doc = json_set(doc, '$.publication', json(?))"
    " WHERE run_id = ? AND json_valid(doc) AND json_extract(doc, '$.attempt') = ?"
    " AND json_extract(doc, '$.publication.stream_seq') IS NOT ?"
    " RETURNING doc"
)
"""A publication record in place, on the same terms. `IS NOT` is `Ne`: a null or absent
`publication` is "not equal", as in `matches` and MongoDB's `$ne`."""


def _in_place(conn: sqlite3.Connection, run_id: str, narrow: NarrowWrite) -> str | None:
    """The written document's text, or None when no row changed."""
    if isinstance(narrow, LeaseRefresh):
        ms = narrow.expires_at_ms
        args: tuple[Any, ...] = (ms, ms, run_id, narrow.token)
        rows: list[tuple[str]] = conn.execute(_REFRESH, args).fetchall()
    else:
        args = (dumps(narrow.publication), run_id, narrow.attempt, narrow.not_stream_seq)
        rows = conn.execute(_RECORD_PUBLICATION, args).fetchall()
    return rows[0][0] if rows else None


def _where(query: RunQuery) -> tuple[str, list[Any]]:
    """`query` as the WHERE, ORDER BY and LIMIT of a SELECT on `runs`, and its arguments."""
    where: list[str] = []
    args: list[Any] = []
    if query.statuses:
        where.append(f"status IN ({','.join('?' * len(query.statuses))})")
        args.extend(str(s) for s in query.statuses)
    if query.tenant is not None:
        where.append("tenant = ?")
        args.append(query.tenant)
    if query.origin is not None:
        where.append("origin = ?")
        args.append(str(query.origin))
    if query.failure_codes:
        where.append(f"failure_code IN ({','.join('?' * len(query.failure_codes))})")
        args.extend(query.failure_codes)
    if query.lease_expires_before is not None:
        where.append("lease_expires_ms IS NOT NULL AND lease_expires_ms < ?")
        args.append(to_ms(query.lease_expires_before))
    if query.created_since is not None:
        where.append("created_ms >= ?")
        args.append(to_ms(query.created_since))
    if query.updated_before is not None:
        where.append("updated_ms < ?")
        args.append(to_ms(query.updated_before))
    if query.workflow is not None:
        where.append(f"{json_field('$.workflow.name')} = ?")
        args.append(query.workflow)
    if query.run_ids:
        where.append(f"run_id IN ({','.join('?' * len(query.run_ids))})")
        args.extend(query.run_ids)
    if query.after_run_id is not None:
        where.append("run_id < ?" if query.newest_first else "run_id > ?")
        args.append(query.after_run_id)
    sql = " WHERE " + " AND ".join(where) if where else ""
    sql += f" ORDER BY run_id {'DESC' if query.newest_first else 'ASC'} LIMIT ?"
    args.append(query.limit)
    return sql, args


REMEMBERED = 1024
"""How many runs' last-seen texts a store keeps (`_Remembered`): a runner's slots, with room."""


class _Remembered:
    """The text this store last read or wrote for each of its recent runs, a hint for the next
    compare-and-set on the same run (issue 19, twelfth pass; ADR-0009 amendment 7).

    A runner reads a run to admit its delivery, then claims it, then finishes it: three reads of
    the same row, each a SQLite statement and, in another process's turn, a re-read of the pages
    it changed. The claim and the finish judge the remembered text instead, and write with the
    guard the optimistic path already has (`AND doc = ?`): a row that changed since (another
    process wrote it) writes nothing, and the write is judged again from a fresh read. A
    conflict found on a remembered text is never answered: it too is judged again from a fresh
    read, so every answer still rests on the row as it is. A hint only, so bounded and lossy."""

    def __init__(self, size: int = REMEMBERED) -> None:
        self._texts: OrderedDict[str, str] = OrderedDict()
        """Oldest first. Each call below is one C-level operation, so a store used from two
        threads cannot corrupt it (at worst a hint is lost)."""
        self._size = size

    def take(self, run_id: str) -> str | None:
        return self._texts.pop(run_id, None)

    def keep(self, run_id: str, text: str) -> None:
        texts = self._texts
        texts.pop(run_id, None)
        texts[run_id] = text
        if len(texts) > self._size:
            with suppress(KeyError):
                texts.popitem(last=False)

    def forget(self, run_id: str) -> None:
        self._texts.pop(run_id, None)


class SqliteRunStore(SqliteEvents, SqliteRecords):
    """The `RunStore` protocol on one SQLite file."""

    _remembered: _Remembered | None = None

    @property
    def remembered(self) -> _Remembered:
        if self._remembered is None:
            self._remembered = _Remembered()
        return self._remembered

    async def create_run(
        self, doc: RunDocument, *, events: Sequence[EventDraft] = ()
    ) -> RunDocument:
        stored = encode(doc)
        at_ms = to_ms(utcnow())

        def insert(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(
                    "INSERT INTO runs (run_id, tenant, status, origin, failure_code,"
                    " lease_expires_ms, created_ms, updated_ms, doc)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (doc.run_id, *run_columns(stored)),
                )
            except sqlite3.IntegrityError as exc:
                raise RunAlreadyExists(f"run {doc.run_id!r} already exists") from exc
            append_drafts(conn, doc.run_id, events, at_ms)

        await self._write(insert)
        return doc

    async def get_run(self, run_id: str) -> RunDocument:
        row = await self._point_read(lambda c: _select_doc(c, run_id))
        if row is None:
            raise RunNotFound(f"no run {run_id!r}")
        self.remembered.keep(run_id, row[0])
        return _run(row[0], run_id)

    async def update_run(
        self,
        run_id: str,
        conditions: Sequence[Condition],
        update: Update,
        *,
        events: Sequence[EventDraft] = (),
    ) -> RunDocument | CasConflict:
        """The compare-and-set, optimistic first (ADR-0009 amendment 4): read the row, judge the
        conditions, apply, validate and encode *outside* the write lock, then write only if the
        row still holds the very text read (`AND doc = ?`, a memcmp in C). Two runner processes
        share one file and one write lock: the Python work of a write (decode, validate,
        encode: most of its CPU) held that lock while it ran, and the other process waited.
        A row that changed between the read and the write is judged again under the lock,
        where nothing can move it: a write is tried at most twice after its read (three
        times when a remembered text went first, amendment 7), and always lands or conflicts."""
        check_update(conditions, update)
        narrow = narrow_write(conditions, update)
        if narrow is not None and not events:
            text = await self._write(lambda conn: _in_place(conn, run_id, narrow))
            if text is not None:
                self.remembered.keep(run_id, text)
                return _run(text, run_id)
            # Nothing changed: the conditions do not hold, the run is gone, or its text is one
            # the JSON functions would rewrite. The general path answers each as before.
        columns = changed_columns(update)
        paths = (*update.set, *update.unset)  # where an unknown field is a misspelling
        sql = (
            "UPDATE runs SET " + "".join(f"{c} = ?, " for c in columns) + "doc = ? WHERE run_id = ?"
        )

        def judged(text: str | None) -> _Judged | CasConflict:
            """The write `text` (the row as read) leads to, or the conflict it answers; the
            conflict is linearised at the read that produced `text`."""
            if text is None:
                raise RunNotFound(f"no run {run_id!r}")
            current = loads(text, "run", run_id)
            if not matches(current, conditions):
                return CasConflict(decode(RunDocument, current, what="run", ident=run_id))
            now_ms = to_ms(utcnow())
            new = apply_update(current, update, now_ms)
            # Validated before writing (a write that would store an invalid run is refused),
            # and that model is the answer: the document is not parsed twice.
            doc = decode(RunDocument, new, what="run update", ident=run_id, written=paths)
            text = dumps(new)
            args = (*(column_value(new, c) for c in columns), text, run_id)
            return _Judged(doc, args, now_ms, text)

        def write(conn: sqlite3.Connection, done: _Judged, *, read: str | None = None) -> bool:
            """`read`: write only if the row still holds that text."""
            guard, extra = (" AND doc = ?", (read,)) if read is not None else ("", ())
            if conn.execute(sql + guard, (*done.args, *extra)).rowcount == 0:
                return False  # moved since the read: nothing written, nothing appended
            append_drafts(conn, run_id, events, done.now_ms)
            return True

        remembered = self.remembered
        hint = remembered.take(run_id)
        if hint is not None:
            # Judged on the text this store last saw; written only if the row still holds it.
            # A conflict, a refusal (the update cannot apply to that text: a parent that was
            # null then), or a row that moved goes on to a fresh read below: the answer is
            # always the row's as it is.
            hinted: _Judged | CasConflict | None
            try:
                hinted = judged(hint)
            except RunfleetError:
                hinted = None
            if isinstance(hinted, _Judged):

                def remembered_write(conn: sqlite3.Connection) -> bool:
                    return write(conn, hinted, read=hint)

                if await self._write(remembered_write):
                    remembered.keep(run_id, hinted.text)
                    return hinted.doc

        read = _text(await self._point_read(lambda c: _select_doc(c, run_id)))
        first = judged(read)
        if isinstance(first, CasConflict):
            return first

        def optimistic(conn: sqlite3.Connection) -> bool:
            return write(conn, first, read=read)

        if await self._write(optimistic):
            remembered.keep(run_id, first.text)
            return first.doc

        def locked(conn: sqlite3.Connection) -> _Judged | CasConflict:
            again = judged(_text(_select_doc(conn, run_id)))
            if not isinstance(again, CasConflict):
                write(conn, again)
            return again

        done = await self._write(locked)  # may run on the store thread: remembered after it
        if isinstance(done, CasConflict):
            return done
        remembered.keep(run_id, done.text)
        return done.doc

    async def list_runs(self, query: RunQuery) -> RunPage:
        where, args = _where(query)
        rows = await self._read(
            lambda c: c.execute(f"SELECT run_id, doc FROM runs{where}", args).fetchall()
        )
        runs: list[RunDocument] = []
        unreadable: list[Unreadable] = []
        for run_id, text in rows:
            try:
                runs.append(_run(text, run_id))
            except DocumentInvalid as exc:
                unreadable.append(Unreadable(run_id, exc.message))
        next_after = rows[-1][0] if len(rows) == query.limit and rows else None
        return RunPage(runs=runs, next_after=next_after, unreadable=unreadable)

    async def list_run_copies(self, query: RunQuery) -> RunCopyPage:
        """SQLite's `json_extract` reads the three fields in C (one parse per row, cached
        across the three calls), so a page costs no Python JSON decode or validation."""
        where, args = _where(query)
        fields = json_field("$.attempt", "$.publication.attempt", "$.publication.stream_seq")
        sql = f"SELECT run_id, status, failure_code, {fields} FROM runs{where}"
        rows = await self._read(lambda c: c.execute(sql, args).fetchall())
        copies = [_copy(*row) for row in rows]
        next_after = copies[-1].run_id if len(copies) == query.limit and copies else None
        return RunCopyPage(copies=copies, next_after=next_after)

    async def status_counts(self, tenant: str | None = None) -> dict[RunStatus, int]:
        sql = "SELECT status, COUNT(*) FROM runs"
        args: tuple[str, ...] = ()
        if tenant is not None:
            sql, args = sql + " WHERE tenant = ?", (tenant,)
        rows = await self._read(lambda c: c.execute(sql + " GROUP BY status", args).fetchall())
        return {RunStatus(status): int(n) for status, n in rows}

    async def delete_run(self, run_id: str) -> bool:
        self.remembered.forget(run_id)

        def delete(conn: sqlite3.Connection) -> bool:
            cur = conn.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM events WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM interactions WHERE run_id = ?", (run_id,))
            return cur.rowcount > 0

        return await self._write(delete)
