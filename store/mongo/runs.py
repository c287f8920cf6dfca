"""`MongoRunStore`: the `RunStore` on MongoDB (SPEC §9), through PyMongo's async client
(ADR-0002, ADR-0008). This module holds the run documents and their compare-and-set; events,
records (interactions, staged uploads, locks) and the connection are its sibling modules.

Only single-document atomic operations, and only the API subset `mongomock-motor` also serves, so
the same code runs on a standalone `mongod` (no replica set, no transactions) and in the
conformance suite. Documents are kept in storage form (`store.codec`: instants as epoch ms), the
same form `store.cas.to_mongo_filter` compares against, so "lease free" means one thing everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from pymongo import ASCENDING, DESCENDING

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
    to_mongo_filter,
    to_storage,
)
from store.codec import decode, encode
from store.errors import DocumentInvalid, RunAlreadyExists, RunNotFound
from store.models import RunDocument, RunStatus
from store.mongo.connection import Doc
from store.mongo.events import MongoEvents
from store.mongo.records import MongoRecords
from store.protocols import EventDraft, RunCopy, RunCopyPage, RunPage, RunQuery, Unreadable
from store.timeutil import to_ms, utcnow

_CAS_TRIES = 50


def _narrow_op(run_id: str, narrow: NarrowWrite) -> tuple[str, Doc, Doc]:
    """A narrow write as a `find_one_and_update`: what it does, the filter and the `$set`."""
    if isinstance(narrow, LeaseRefresh):
        return (
            "refresh lease",
            {"_id": run_id, "lease.token": narrow.token},
            {"$set": {"lease.expires_at": narrow.expires_at_ms}},
        )
    return (
        "record publication",
        {
            "_id": run_id,
            "attempt": narrow.attempt,
            "publication.stream_seq": {"$ne": narrow.not_stream_seq},
        },
        {"$set": {"publication": narrow.publication}},
    )


def _holds(doc: Doc, sets: Doc) -> bool:
    landed = Update(set=sets, bump_version=False)
    return apply_update(doc, landed, 0) == doc


def _null_safe(clause: Doc) -> Doc:
    """mongomock does not match `{"lease.token": None}` (nor `$in: [None]`) when `lease` itself is
    null, where a real server does; naming the parents too changes nothing on a real server."""
    if len(clause) != 1:
        return clause
    ((path, want),) = clause.items()
    if path.startswith("$") or "." not in path:
        return clause
    if want is not None and not (isinstance(want, dict) and None in want.get("$in", ())):
        return clause
    parts = path.split(".")
    return {"$or": [clause, *({".".join(parts[:i]): None} for i in range(1, len(parts)))]}


_COPY_FIELDS = {
    "attempt": 1,
    "publication.attempt": 1,
    "publication.stream_seq": 1,
    "status": 1,
    "failure_code": 1,
}


def _filter(query: RunQuery) -> tuple[Doc, int]:
    """`query` as a `find` filter, and the `_id` order."""
    clauses: list[Doc] = []
    if query.statuses:
        clauses.append({"status": {"$in": [to_storage(s) for s in query.statuses]}})
    if query.tenant is not None:
        clauses.append({"tenant": query.tenant})
    if query.origin is not None:
        clauses.append({"origin": to_storage(query.origin)})
    if query.failure_codes:
        clauses.append({"failure_code": {"$in": list(query.failure_codes)}})
    if query.lease_expires_before is not None:
        clauses.append({"lease.expires_at": {"$lt": to_ms(query.lease_expires_before)}})
    if query.created_since is not None:
        clauses.append({"created_at": {"$gte": to_ms(query.created_since)}})
    if query.updated_before is not None:
        clauses.append({"updated_at": {"$lt": to_ms(query.updated_before)}})
    if query.workflow is not None:
        clauses.append({"workflow.name": query.workflow})
    if query.run_ids:
        clauses.append({"_id": {"$in": list(query.run_ids)}})
    if query.after_run_id is not None:
        clauses.append({"_id": {"$lt" if query.newest_first else "$gt": query.after_run_id}})
    flt: Doc = {"$and": clauses} if clauses else {}
    return flt, DESCENDING if query.newest_first else ASCENDING


class MongoRunStore(MongoEvents, MongoRecords):
    """The MongoDB `RunStore`. Pass a database (tests pass a mongomock-motor one) or `connect()`."""

    def _run(self, raw: Doc) -> RunDocument:
        return decode(RunDocument, raw, what="run", ident=str(raw.get("_id")))

    async def create_run(
        self, doc: RunDocument, *, events: Sequence[EventDraft] = ()
    ) -> RunDocument:
        if not await self._insert("create run", self._runs, {**encode(doc), "_id": doc.run_id}):
            raise RunAlreadyExists(f"run {doc.run_id!r} already exists")
        # Single-document operations: the events follow the insert (one `insert_many`).
        await self._append_drafts(doc.run_id, events, utcnow())
        return doc

    async def get_run(self, run_id: str) -> RunDocument:
        raw = await self._io("get run", self._runs.find_one, {"_id": run_id})
        if raw is None:
            raise RunNotFound(f"no run {run_id!r}")
        return self._run(raw)

    async def update_run(
        self,
        run_id: str,
        conditions: Sequence[Condition],
        update: Update,
        *,
        events: Sequence[EventDraft] = (),
    ) -> RunDocument | CasConflict:
        written = await self._cas(run_id, conditions, update)
        if not isinstance(written, CasConflict):
            # Single-document operations: the write's events follow it (one `insert_many`).
            await self._append_drafts(run_id, events, utcnow())
        return written

    async def _cas(
        self, run_id: str, conditions: Sequence[Condition], update: Update
    ) -> RunDocument | CasConflict:
        """Judge on a fresh read, validate the result, then write only if the document is still
        the version judged (and the conditions still hold, for writes that skip the version).

        The pre-read is what keeps an invalid document (a misspelt nested path) from ever being
        stored, and what refuses a path `mongod` would refuse (`UnwritablePath`) where mongomock
        would drop it: MongoDB would apply it blindly. Losing to a concurrent write re-judges.
        """
        check_update(conditions, update)
        narrow = narrow_write(conditions, update)
        if narrow is not None:
            # A narrow write needs no pre-read: one known field, validated by itself, set where
            # the conditions hold (issue 19, lever 2; ADR-0008 amendment). No match falls
            # through to the general path, which says why.
            what, where, narrow_set = _narrow_op(run_id, narrow)
            raw, retried = await self._find_one_and_update(what, self._runs, where, narrow_set)
            if raw is not None:
                return self._run(raw)
            if retried:  # the first try may have landed: then the doc holds what it set
                latest = await self._io("re-read run", self._runs.find_one, {"_id": run_id})
                if latest is not None and _holds(latest, narrow_set["$set"]):
                    return self._run(latest)
        now_ms = to_ms(utcnow())
        paths = (*update.set, *update.unset)  # where an unknown field is a misspelling
        stored = Update(
            set={path: to_storage(value) for path, value in update.set.items()},
            unset=update.unset,
            bump_version=update.bump_version,
        )
        ops: Doc = {}
        if update.bump_version:
            ops["$inc"] = {"version": 1}
        if sets := {**stored.set, **({"updated_at": now_ms} if update.bump_version else {})}:
            ops["$set"] = sets
        if update.unset:
            ops["$unset"] = {path: "" for path in update.unset}
        guard = [_null_safe(c) for c in to_mongo_filter(run_id, conditions)["$and"]]
        current = None
        for _ in range(_CAS_TRIES):
            current = await self._io("read run", self._runs.find_one, {"_id": run_id})
            if current is None:
                raise RunNotFound(f"no run {run_id!r}")
            if not matches(current, conditions):
                break
            new = apply_update(current, stored, now_ms)
            # refused before writing; an unknown field where the update writes is refused
            decode(RunDocument, new, what="run update", ident=run_id, written=paths)
            if not ops:
                return self._run(current)
            flt = {"$and": [*guard, {"version": current.get("version")}]}
            raw, retried = await self._find_one_and_update("update run", self._runs, flt, ops)
            if raw is not None:
                return self._run(raw)
            if retried:  # the first attempt may have landed before its connection dropped
                latest = await self._io("re-read run", self._runs.find_one, {"_id": run_id})
                landed = Update(set=stored.set, unset=update.unset, bump_version=False)
                if latest is not None and apply_update(latest, landed, now_ms) == latest:
                    return self._run(latest)
        assert current is not None
        return CasConflict(self._run(current))

    async def list_runs(self, query: RunQuery) -> RunPage:
        flt, order = _filter(query)
        raws = await self._find("list runs", self._runs, flt, [("_id", order)], query.limit)
        runs: list[RunDocument] = []
        unreadable: list[Unreadable] = []
        for raw in raws:
            try:
                runs.append(self._run(raw))
            except DocumentInvalid as exc:
                unreadable.append(Unreadable(str(raw.get("_id")), exc.message))
        full = query.limit > 0 and len(raws) == query.limit
        last = str(raws[-1]["_id"]) if raws else None
        return RunPage(runs=runs, next_after=last if full else None, unreadable=unreadable)

    async def list_run_copies(self, query: RunQuery) -> RunCopyPage:
        """A projection of the three fields: the server sends no documents."""
        flt, order = _filter(query)
        raws = await self._find(
            "list run copies", self._runs, flt, [("_id", order)], query.limit, _COPY_FIELDS
        )
        copies = []
        for raw in raws:
            pub = raw.get("publication") or {}
            if not isinstance(pub, dict):
                pub = {}
            attempt = raw.get("attempt")
            if not isinstance(attempt, int) or isinstance(attempt, bool):
                attempt = 0  # the sweeper reads the run, meets its error and passes on
            copies.append(
                RunCopy(
                    raw["_id"],
                    attempt,
                    pub.get("attempt"),
                    pub.get("stream_seq"),
                    raw.get("status"),
                    raw.get("failure_code"),
                )
            )
        full = query.limit > 0 and len(copies) == query.limit
        return RunCopyPage(copies=copies, next_after=copies[-1].run_id if full else None)

    async def status_counts(self, tenant: str | None = None) -> dict[RunStatus, int]:
        """One `count_documents` per status (no awaited `aggregate`: mongomock lacks it)."""
        counts: dict[RunStatus, int] = {}
        for status in RunStatus:
            flt: Doc = {"status": status.value}
            if tenant is not None:
                flt["tenant"] = tenant
            n = await self._io("count runs", self._runs.count_documents, flt)
            if n:
                counts[status] = int(n)
        return counts

    async def delete_run(self, run_id: str) -> bool:
        """Projections first: if this stops half-way the run is still there for `gc` to find."""
        self._recent.forget(run_id)
        await self._io("delete events", self._events.delete_many, {"run_id": run_id})
        await self._io("delete interactions", self._interactions.delete_many, {"run_id": run_id})
        result = await self._io("delete run", self._runs.delete_one, {"_id": run_id})
        return result.deleted_count > 0
