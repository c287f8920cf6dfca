"""The SQLite `RunStore`, the embedded default (SPEC §9, ADR-0003, ADR-0009), by concept: `runs`
(the documents and their compare-and-set, and the assembled `SqliteRunStore`), `events`,
`records` (interactions, staged uploads, locks), `connection` (the worker thread and error
translation), `schema` (tables, JSON form, query columns). The worker is `store.sqlite_worker`."""

from store.sqlite.runs import SqliteRunStore
from store.sqlite.schema import connect

__all__ = ["SqliteRunStore", "connect"]
