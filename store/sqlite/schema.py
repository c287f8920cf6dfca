"""The SQLite store's file: schema, connection settings, the JSON form of documents, the query
columns copied beside each run's `doc`, and the translation of sqlite3 errors.

Documents are stored as JSON in storage form (instants as epoch ms); the columns beside `doc` are
copies of the fields the queries filter on; a write rewrites the ones it can change.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import orjson

from store.cas import Update
from store.errors import StoreCorrupt, StoreError, StoreUnavailable
from store.sqlite.checkpointer import BACKSTOP_PAGES

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


def connect(path: Path, busy_timeout_ms: int) -> sqlite3.Connection:
    """A connection in WAL mode with the schema in place (blocking: call it off the loop)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_ms / 1000
    )
    try:
        conn.create_function("runfleet_json_extract", -1, json_extract, deterministic=True)
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        # Checkpoints run on their own thread (`checkpointer`); a commit runs one only as a
        # backstop, far past SQLite's default of 1 000 pages.
        conn.execute(f"PRAGMA wal_autocheckpoint = {BACKSTOP_PAGES}")
        conn.executescript(_SCHEMA)
    except sqlite3.DatabaseError:
        conn.close()
        raise
    return conn


def json_extract(doc: str, *paths: str) -> Any:
    """SQLite's `json_extract` (one path: the value; several: their JSON array) for a document
    SQLite's own JSON functions refuse: Python's `json` writes a NaN or an infinity a node
    output as `NaN`/`Infinity`. Queries call it only where `json_valid(doc)` is false
    (`json_field`), so it costs nothing on other rows. Plain `$.a.b` paths only."""
    try:
        value = json.loads(doc)
    except json.JSONDecodeError:
        return None
    found = []
    for path in paths:
        node = value
        for key in path.removeprefix("$.").split("."):
            node = node.get(key) if isinstance(node, dict) else None
        found.append(node if isinstance(node, str | int | float) or node is None else None)
    return found[0] if len(found) == 1 else json.dumps(found, separators=(",", ":"))


def json_field(*paths: str) -> str:
    """The SQL of `json_extract(doc, paths...)` that reads every stored document, including
    one SQLite's JSON functions refuse (see `json_extract`)."""
    quoted = ", ".join(f"'{p}'" for p in paths)
    return (
        f"CASE WHEN json_valid(doc) THEN json_extract(doc, {quoted})"
        f" ELSE runfleet_json_extract(doc, {quoted}) END"
    )


def translate(exc: sqlite3.Error, path: Path) -> StoreError:
    """Classify by SQLite's result code (never by message text)."""
    primary = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    if primary in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_CANTOPEN):
        return StoreUnavailable(f"SQLite store {path}: {exc}")
    if primary in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return StoreCorrupt(f"SQLite store {path} is corrupt: {exc}")
    if primary == sqlite3.SQLITE_FULL:
        # The disk is full: nothing is wrong with the store, and it works again once space
        # is freed (a disk-full drill: `error [store_error]`, exit 1, no remedy).
        return StoreUnavailable(
            f"SQLite store {path}: {exc}",
            remedy=f"free space on the disk holding {path.parent} (`df -h {path.parent}`;"
            " `runfleet gc` itself needs a little to delete runs), then retry",
        )
    if primary == sqlite3.SQLITE_READONLY:
        return StoreUnavailable(
            f"SQLite store {path}: {exc}",
            remedy=f"make {path} and its directory writable by this user, then retry",
        )
    if primary == sqlite3.SQLITE_IOERR:
        return StoreUnavailable(
            f"SQLite store {path}: {exc}",
            remedy=f"the disk under {path.parent} failed a read or a write (a disk error, or"
            " a filesystem remounted read-only after one): check the kernel log (`dmesg`)"
            " and the disk, then retry",
        )
    return StoreError(f"SQLite store {path}: {exc}")


_ENCODER = json.JSONEncoder(separators=(",", ":"))
"""The fallback encoder (`json.dumps` with options builds a new one per call). ASCII only: a
lone surrogate, which a node's output may hold, is written as its `\\u` escape; raw, sqlite3
cannot encode it and the write failed."""


def dumps(doc: dict[str, Any]) -> str:
    """The stored JSON of a storage-form document. orjson writes it in a tenth of `json`'s time
    (issue 19: encoding was ≈ 7 % of a runner's CPU), but it writes NaN and ±infinity as `null`,
    silently, and a compute node may output them. So its text is read back and compared with
    the document (C-speed, both ways): any difference (a NaN, a float that would not round-trip)
    or anything orjson refuses (an int past 64 bits, a non-string key, a lone surrogate) falls
    back to `json`, which writes NaN as `NaN`, big ints whole, and escapes the rest. Readers
    never use orjson (it reads an int past 64 bits as a float): pydantic's JSON reader or
    `json` reads every text either writer wrote (tests/store/test_sqlite_json.py)."""
    try:
        out = orjson.dumps(doc)
    except TypeError:
        return _ENCODER.encode(doc)
    if orjson.loads(out) != doc:
        return _ENCODER.encode(doc)
    return out.decode()


def loads(text: str, what: str, ident: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise StoreCorrupt(f"stored {what} {ident!r} is not valid JSON: {exc}") from exc


_COLUMN_OF = {"status": "status", "origin": "origin", "failure_code": "failure_code"}


def changed_columns(update: Update) -> tuple[str, ...]:
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


def column_value(doc: dict[str, Any], column: str) -> Any:
    if column == "lease_expires_ms":
        return (doc.get("lease") or {}).get("expires_at")
    if column in ("created_ms", "updated_ms"):
        return doc[column.replace("_ms", "_at")]
    return doc.get(column)


def run_columns(doc: dict[str, Any]) -> tuple[Any, ...]:
    """Every query column of a run, then its `doc`: the values of an INSERT into `runs`."""
    return (*(column_value(doc, c) for c in _QUERY_COLUMNS), dumps(doc))
