"""`SqliteRunStore`: the embedded default (SPEC §9, ADR-0003).

One file in WAL mode, shared by several processes (`runfleet up` runs N runner processes on it).
Each store instance owns one connection used from one dedicated thread (`SqliteWorker`), and
every operation is a function submitted to that thread in a single hop: the event loop never
blocks on disk, and a compare-and-set is `SELECT; UPDATE` inside a `BEGIN IMMEDIATE` transaction
with no await in between, so it is atomic against other tasks *and* other processes (IMMEDIATE
takes the write lock first). Writes waiting together share one transaction (group commit, see
`store.sqlite_worker` and ADR-0009); none is reported before its commit.

Documents are stored as JSON in storage form (instants as epoch ms); the columns beside `doc` are
copies of the fields the queries filter on; a write rewrites the ones it can change.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from store.cas import CasConflict, Condition, Update, apply_update, check_update, matches
from store.codec import decode, encode
from store.errors import (
    RunAlreadyExists,
    RunNotFound,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
)
from store.models import (
    Event,
    Interaction,
    InteractionStatus,
    RunDocument,
    RunStatus,
    StagedUpload,
)
from store.protocols import EventDraft, RunPage, RunQuery
from store.sqlite_worker import SqliteWorker
from store.timeutil import to_ms, utcnow

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    status TEXT NOT NULL,
    origin TEXT NOT NULL,
    failure_code TEXT,
    lease_expires_ms INTEGER,
    created_ms INTEGER NOT NULL,
    updated_ms INTEGER NOT NULL,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status, run_id);
CREATE INDEX IF NOT EXISTS runs_tenant ON runs (tenant, run_id);
CREATE INDEX IF NOT EXISTS runs_lease ON runs (lease_expires_ms);
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    doc TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE IF NOT EXISTS interactions (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    status TEXT NOT NULL,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS interactions_run ON interactions (run_id);
CREATE TABLE IF NOT EXISTS staged_uploads (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS locks (
    name TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    expires_ms INTEGER NOT NULL
);
"""


def _dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def _loads(text: str, what: str, ident: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise StoreCorrupt(f"stored {what} {ident!r} is not valid JSON: {exc}") from exc


_COLUMN_OF = {"status": "status", "origin": "origin", "failure_code": "failure_code"}


def _changed_columns(update: Update) -> tuple[str, ...]:
    """The query columns an update can change (besides `doc`). Setting only those keeps SQLite
    from rewriting index entries whose value did not move: a lease refresh or a checkpoint
    touches no index but the lease's."""
    tops = {path.split(".", 1)[0] for path in [*update.set, *update.unset]}
    columns = [_COLUMN_OF[top] for top in sorted(tops) if top in _COLUMN_OF]
    if "lease" in tops:
        columns.append("lease_expires_ms")
    if update.bump_version:
        columns.append("updated_ms")
    return tuple(columns)


_QUERY_COLUMNS = (
    "tenant",
    "status",
    "origin",
    "failure_code",
    "lease_expires_ms",
    "created_ms",
    "updated_ms",
)
"""The copies of document fields beside `doc`, in the `runs` table's column order."""


def _column_value(doc: dict[str, Any], column: str) -> Any:
    if column == "lease_expires_ms":
        return (doc.get("lease") or {}).get("expires_at")
    if column in ("created_ms", "updated_ms"):
        return doc[column.replace("_ms", "_at")]
    return doc.get(column)


def _run_columns(doc: dict[str, Any]) -> tuple[Any, ...]:
    return (*(_column_value(doc, c) for c in _QUERY_COLUMNS), _dumps(doc))


def connect(path: Path, busy_timeout_ms: int) -> sqlite3.Connection:
    """A connection in WAL mode with the schema in place (blocking: call it off the loop)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_ms / 1000
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.executescript(_SCHEMA)
    except sqlite3.DatabaseError:
        conn.close()
        raise
    return conn


class SqliteRunStore:
    """The `RunStore` protocol on one SQLite file."""

    def __init__(self, path: Path, worker: SqliteWorker) -> None:
        self.path = path
        self._worker = worker

    @classmethod
    async def open(cls, path: Path | str, *, busy_timeout_ms: int = 10_000) -> SqliteRunStore:
        """Open (creating if needed) the store file. A file that is not a SQLite database is a
        `StoreCorrupt` naming it; it is never overwritten."""
        path = Path(path)
        try:
            worker = await SqliteWorker.start(
                lambda: connect(path, busy_timeout_ms),
                f"sqlite-{path.name}",
                busy_timeout_s=busy_timeout_ms / 1000,
            )
        except sqlite3.DatabaseError as exc:
            raise _translate(exc, path) from exc
        return cls(path, worker)

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        try:
            return await self._worker.read(fn)
        except sqlite3.Error as exc:
            raise _translate(exc, self.path) from exc

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` runs inside a write transaction (shared with other writes): no BEGIN/COMMIT."""
        try:
            return await self._worker.write(fn)
        except sqlite3.Error as exc:
            raise _translate(exc, self.path) from exc

    # -- runs ---------------------------------------------------------------------------------

    async def create_run(
        self, doc: RunDocument, *, first_event: EventDraft | None = None
    ) -> RunDocument:
        stored = encode(doc)
        at = utcnow()

        def insert(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(
                    "INSERT INTO runs (run_id, tenant, status, origin, failure_code,"
                    " lease_expires_ms, created_ms, updated_ms, doc)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (doc.run_id, *_run_columns(stored)),
                )
            except sqlite3.IntegrityError as exc:
                raise RunAlreadyExists(f"run {doc.run_id!r} already exists") from exc
            if first_event is not None:
                _append(conn, doc.run_id, first_event, at)

        await self._write(insert)
        return doc

    async def get_run(self, run_id: str) -> RunDocument:
        row = await self._read(
            lambda c: c.execute("SELECT doc FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        )
        if row is None:
            raise RunNotFound(f"no run {run_id!r}")
        return decode(RunDocument, _loads(row[0], "run", run_id), what="run", ident=run_id)

    async def update_run(
        self, run_id: str, conditions: Sequence[Condition], update: Update
    ) -> RunDocument | CasConflict:
        check_update(conditions, update)
        columns = _changed_columns(update)
        sql = (
            "UPDATE runs SET " + "".join(f"{c} = ?, " for c in columns) + "doc = ? WHERE run_id = ?"
        )

        def cas(conn: sqlite3.Connection) -> RunDocument | CasConflict:
            row = conn.execute("SELECT doc FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                raise RunNotFound(f"no run {run_id!r}")
            current = _loads(row[0], "run", run_id)
            if not matches(current, conditions):
                return CasConflict(decode(RunDocument, current, what="run", ident=run_id))
            new = apply_update(current, update, to_ms(utcnow()))
            # Validated before writing (a write that would store an invalid run is refused),
            # and that model is the answer: the document is not parsed twice.
            doc = decode(RunDocument, new, what="run update", ident=run_id)
            conn.execute(sql, (*(_column_value(new, c) for c in columns), _dumps(new), run_id))
            return doc

        return await self._write(cas)

    async def list_runs(self, query: RunQuery) -> RunPage:
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
        if query.after_run_id is not None:
            where.append("run_id > ?")
            args.append(query.after_run_id)
        sql = "SELECT run_id, doc FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY run_id LIMIT ?"
        args.append(query.limit)
        rows = await self._read(lambda c: c.execute(sql, args).fetchall())
        runs = [decode(RunDocument, _loads(d, "run", r), what="run", ident=r) for r, d in rows]
        next_after = runs[-1].run_id if len(runs) == query.limit and runs else None
        return RunPage(runs=runs, next_after=next_after)

    async def status_counts(self, tenant: str | None = None) -> dict[RunStatus, int]:
        sql = "SELECT status, COUNT(*) FROM runs"
        args: tuple[str, ...] = ()
        if tenant is not None:
            sql, args = sql + " WHERE tenant = ?", (tenant,)
        rows = await self._read(lambda c: c.execute(sql + " GROUP BY status", args).fetchall())
        return {RunStatus(status): int(n) for status, n in rows}

    async def delete_run(self, run_id: str) -> bool:
        def delete(conn: sqlite3.Connection) -> bool:
            cur = conn.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM events WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM interactions WHERE run_id = ?", (run_id,))
            return cur.rowcount > 0

        return await self._write(delete)

    # -- events -------------------------------------------------------------------------------

    async def append_event(
        self,
        run_id: str,
        type: str,
        data: dict[str, Any] | None = None,
        *,
        attempt: int | None = None,
        execution: str | None = None,
    ) -> Event:
        at = utcnow()

        def append(conn: sqlite3.Connection) -> Event:
            return _append(conn, run_id, EventDraft(type, data or {}, attempt, execution), at)

        return await self._write(append)

    async def read_events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]:
        rows = await self._read(
            lambda c: c.execute(
                "SELECT seq, doc FROM events WHERE run_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (run_id, after_seq, limit),
            ).fetchall()
        )
        return [
            decode(Event, _loads(d, "event", f"{run_id}#{s}"), what="event", ident=f"{run_id}#{s}")
            for s, d in rows
        ]

    # -- interactions -------------------------------------------------------------------------

    async def put_interaction(self, interaction: Interaction) -> Interaction:
        def put(conn: sqlite3.Connection) -> str:
            conn.execute(
                "INSERT OR IGNORE INTO interactions (id, run_id, status, doc) VALUES (?, ?, ?, ?)",
                (
                    interaction.id,
                    interaction.run_id,
                    str(interaction.status),
                    _dumps(encode(interaction)),
                ),
            )
            row = conn.execute(
                "SELECT doc FROM interactions WHERE id = ?", (interaction.id,)
            ).fetchone()
            return str(row[0])

        text = await self._write(put)
        return self._interaction(text, interaction.id)

    def _interaction(self, text: str, ident: str) -> Interaction:
        return decode(
            Interaction, _loads(text, "interaction", ident), what="interaction", ident=ident
        )

    async def answer_interaction(
        self, interaction_id: str, answers: dict[str, Any], at: datetime
    ) -> Interaction | None:
        def answer(conn: sqlite3.Connection) -> str | None:
            row = conn.execute(
                "SELECT doc FROM interactions WHERE id = ? AND status = ?",
                (interaction_id, InteractionStatus.PENDING.value),
            ).fetchone()
            if row is None:
                return None
            doc = _loads(row[0], "interaction", interaction_id)
            doc.update(status="answered", answers=answers, answered_at=to_ms(at))
            conn.execute(
                "UPDATE interactions SET status = 'answered', doc = ? WHERE id = ?",
                (_dumps(doc), interaction_id),
            )
            return _dumps(doc)

        text = await self._write(answer)
        return None if text is None else self._interaction(text, interaction_id)

    async def retire_interactions(self, run_id: str) -> int:
        def retire(conn: sqlite3.Connection) -> int:
            rows = conn.execute(
                "SELECT id, doc FROM interactions WHERE run_id = ? AND status = 'pending'",
                (run_id,),
            ).fetchall()
            for ident, text in rows:
                doc = _loads(text, "interaction", ident)
                doc["status"] = "retired"
                conn.execute(
                    "UPDATE interactions SET status = 'retired', doc = ? WHERE id = ?",
                    (_dumps(doc), ident),
                )
            return len(rows)

        return await self._write(retire)

    async def list_interactions(
        self, run_id: str, *, pending_only: bool = False
    ) -> list[Interaction]:
        sql = "SELECT id, doc FROM interactions WHERE run_id = ?"
        if pending_only:
            sql += " AND status = 'pending'"
        rows = await self._read(lambda c: c.execute(sql + " ORDER BY id", (run_id,)).fetchall())
        return [self._interaction(text, ident) for ident, text in rows]

    # -- staged uploads -----------------------------------------------------------------------

    async def put_staged_upload(self, record: StagedUpload) -> None:
        def put(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(
                    "INSERT INTO staged_uploads (id, tenant, created_ms, doc) VALUES (?, ?, ?, ?)",
                    (record.id, record.tenant, to_ms(record.created_at), _dumps(encode(record))),
                )
            except sqlite3.IntegrityError as exc:
                raise StoreError(f"staged upload {record.id!r} already exists") from exc

        await self._write(put)

    async def get_staged_upload(self, upload_id: str, tenant: str) -> StagedUpload | None:
        row = await self._read(
            lambda c: c.execute(
                "SELECT doc FROM staged_uploads WHERE id = ? AND tenant = ?", (upload_id, tenant)
            ).fetchone()
        )
        if row is None:
            return None
        raw = _loads(row[0], "staged upload", upload_id)
        return decode(StagedUpload, raw, what="staged upload", ident=upload_id)

    async def delete_staged_upload(self, upload_id: str, tenant: str) -> bool:
        return await self._write(
            lambda c: (
                c.execute(
                    "DELETE FROM staged_uploads WHERE id = ? AND tenant = ?", (upload_id, tenant)
                ).rowcount
                > 0
            )
        )

    async def list_staged_uploads_before(
        self, cutoff: datetime, limit: int = 100
    ) -> list[StagedUpload]:
        rows = await self._read(
            lambda c: c.execute(
                "SELECT id, doc FROM staged_uploads WHERE created_ms < ? ORDER BY created_ms"
                " LIMIT ?",
                (to_ms(cutoff), limit),
            ).fetchall()
        )
        return [
            decode(StagedUpload, _loads(d, "staged upload", i), what="staged upload", ident=i)
            for i, d in rows
        ]

    # -- locks, health ------------------------------------------------------------------------

    async def try_lock(self, name: str, owner: str, now: datetime, ttl_s: float) -> bool:
        now_ms = to_ms(now)
        expires = now_ms + int(ttl_s * 1000)

        def lock(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "INSERT INTO locks (name, owner, expires_ms) VALUES (?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET owner = excluded.owner,"
                " expires_ms = excluded.expires_ms"
                " WHERE locks.owner = excluded.owner OR locks.expires_ms <= ?",
                (name, owner, expires, now_ms),
            )
            return cur.rowcount > 0

        return await self._write(lock)

    async def ping(self) -> None:
        await self._read(lambda c: c.execute("SELECT 1").fetchone())

    async def close(self) -> None:
        await self._worker.close()


def _append(conn: sqlite3.Connection, run_id: str, draft: EventDraft, at: datetime) -> Event:
    """Append inside the caller's write transaction. The transaction (IMMEDIATE) serialises
    appenders across processes, so max(seq)+1 cannot collide; the primary key would refuse a
    duplicate if it did."""
    (last,) = conn.execute(
        "SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_id = ?", (run_id,)
    ).fetchone()
    event = Event(
        run_id=run_id,
        seq=last + 1,
        type=draft.type,
        attempt=draft.attempt,
        execution=draft.execution,
        at=at,
        data=draft.data,
    )
    conn.execute(
        "INSERT INTO events (run_id, seq, doc) VALUES (?, ?, ?)",
        (run_id, event.seq, _dumps(encode(event))),
    )
    return event


def _translate(exc: sqlite3.Error, path: Path) -> StoreError:
    """Classify by SQLite's result code (never by message text)."""
    primary = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    if primary in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_CANTOPEN):
        return StoreUnavailable(f"SQLite store {path}: {exc}")
    if primary in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return StoreCorrupt(f"SQLite store {path} is corrupt: {exc}")
    return StoreError(f"SQLite store {path}: {exc}")
