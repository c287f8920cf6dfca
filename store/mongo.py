"""`RunStore` on MongoDB (SPEC §9), through PyMongo's async client (ADR-0002, ADR-0008).

Only single-document atomic operations, and only the API subset `mongomock-motor` also serves, so
the same code runs on a standalone `mongod` (no replica set, no transactions) and in the
conformance suite. Documents are kept in storage form (`store.codec`: instants as epoch ms), the
same form `store.cas.to_mongo_filter` compares against, so "lease free" means one thing everywhere.

Transient driver errors are retried (bounded) and then become `StoreUnavailable`; any other driver
error becomes `StoreError`. A retried write may already have landed before its connection dropped
(a standalone `mongod` has no retryable writes), so each write recognises its own earlier attempt
instead of reporting it as a conflict or a duplicate.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ParamSpec, TypeVar

from bson.errors import BSONError
from pydantic import BaseModel
from pymongo import ASCENDING, DESCENDING, AsyncMongoClient, ReturnDocument
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import ConnectionFailure, DuplicateKeyError, PyMongoError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from store.cas import (
    CasConflict,
    Condition,
    Update,
    apply_update,
    check_update,
    matches,
    to_mongo_filter,
    to_storage,
)
from store.codec import decode, encode
from store.errors import (
    InvalidStoreUrl,
    RunAlreadyExists,
    RunNotFound,
    StoreError,
    StoreUnavailable,
)
from store.models import (
    Event,
    Interaction,
    InteractionStatus,
    LockRecord,
    RunDocument,
    RunStatus,
    StagedUpload,
)
from store.protocols import EventDraft, RunPage, RunQuery
from store.timeutil import to_ms, utcnow

P = ParamSpec("P")
T = TypeVar("T")
Doc = dict[str, Any]

_TRANSIENT = (ConnectionFailure,)
"""AutoReconnect, NetworkTimeout and ServerSelectionTimeoutError all derive from it."""
_APPEND_TRIES = 200
_CAS_TRIES = 50
_RECENT_RUNS = 4096
_SEQ_ONLY = {"_id": 0, "seq": 1}
"""Covered by the `(run_id, seq)` index on a real server; spares mongomock copying each event."""
_PENDING = InteractionStatus.PENDING.value


def _storage(value: Any) -> Any:
    """`cas.to_storage`, reaching into pydantic models too (callers set `lease=Lease(...)`)."""
    if isinstance(value, BaseModel):
        return encode(value)
    if isinstance(value, Mapping):
        return {str(k): _storage(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_storage(v) for v in value]
    return to_storage(value)


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


@dataclass(slots=True)
class _RecentRun:
    """What this process knows about a run it appended to."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_seq: int | None = None


def _brief(exc: BaseException) -> str:
    """Server-selection errors append a whole topology description; it stays on `__cause__`."""
    text = str(exc)
    return text if len(text) <= 300 else text[:300] + "…"


_USERINFO = re.compile(r"(?<=://)([^@/?#]*)@")


def redact_url(url: str) -> str:
    """The URL with its credentials replaced, safe for error messages and logs."""
    return _USERINFO.sub("***@", url)


def _scrub(text: str, url: str) -> str:
    """A driver message with the URL's password removed (URI parse errors may quote it)."""
    found = _USERINFO.search(url)
    secret = found.group(1).partition(":")[2] if found else ""
    return text.replace(secret, "***") if secret else text


class MongoRunStore:
    """The MongoDB `RunStore`. Pass a database (tests pass a mongomock-motor one) or `connect()`."""

    def __init__(
        self,
        db: AsyncDatabase[Doc],
        *,
        client: AsyncMongoClient[Doc] | None = None,
        retry_attempts: int = 5,
        label: str = "MongoDB",
    ) -> None:
        self._db = db
        self._client = client  # owned (closed by `close`) only when `connect` made it
        self._attempts = retry_attempts
        self._label = label
        self._runs: AsyncCollection[Doc] = db["runs"]
        self._events: AsyncCollection[Doc] = db["events"]
        self._interactions: AsyncCollection[Doc] = db["interactions"]
        self._staged: AsyncCollection[Doc] = db["staged_uploads"]
        self._locks: AsyncCollection[Doc] = db["locks"]
        self._indexed = False
        self._recent: OrderedDict[str, _RecentRun] = OrderedDict()
        self._index_lock = asyncio.Lock()

    @classmethod
    async def connect(
        cls,
        url: str,
        db_name: str | None = None,
        *,
        server_selection_timeout_ms: int = 5000,
        retry_attempts: int = 5,
    ) -> MongoRunStore:
        """Open, ping and index, so a wrong URL fails at start with the (redacted) URL named."""
        shown = redact_url(url)
        try:
            client: AsyncMongoClient[Doc] = AsyncMongoClient(
                url, tz_aware=True, serverSelectionTimeoutMS=server_selection_timeout_ms
            )
            db = client[db_name] if db_name else client.get_default_database("runfleet")
        except (PyMongoError, ValueError, TypeError) as exc:  # a bad URI: nothing to retry
            raise InvalidStoreUrl(
                f"cannot use MongoDB URL {shown}: {_scrub(str(exc), url)}"
            ) from exc
        store = cls(db, client=client, retry_attempts=retry_attempts, label=f"MongoDB at {shown}")
        try:
            await store.ping()
            await store.ensure_indexes()
        except BaseException:
            await client.close()
            raise
        return store

    # -- plumbing ---------------------------------------------------------------------------

    async def _call(
        self, what: str, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run one driver call with bounded retries; translate what escapes into our errors.

        `DuplicateKeyError` passes through untranslated: callers decide what a duplicate means.
        """
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential(multiplier=0.05, min=0.05, max=1.0),
            retry=retry_if_exception_type(_TRANSIENT),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await fn(*args, **kwargs)
        except DuplicateKeyError:
            raise
        except _TRANSIENT as exc:
            raise StoreUnavailable(
                f"{self._label} unreachable during {what}: {_brief(exc)}"
            ) from exc
        except (PyMongoError, BSONError) as exc:
            raise StoreError(f"{self._label} failed during {what}: {_brief(exc)}") from exc
        raise AssertionError("tenacity stopped without a result")  # pragma: no cover

    async def _io(
        self, what: str, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """`_call`, after the indexes exist: the unique `(run_id, seq)` index is what keeps
        event sequences gap-free, so no write may run before it."""
        if not self._indexed:
            async with self._index_lock:
                if not self._indexed:
                    await self.ensure_indexes()
        return await self._call(what, fn, *args, **kwargs)

    async def _find(
        self,
        what: str,
        coll: AsyncCollection[Doc],
        filter: Mapping[str, Any],
        sort: list[tuple[str, int]],
        limit: int = 0,
        projection: Mapping[str, Any] | None = None,
    ) -> list[Doc]:
        async def op() -> list[Doc]:
            cursor = coll.find(filter, projection).limit(limit)
            return await (cursor.sort(sort) if sort else cursor).to_list(None)

        return await self._io(what, op)

    async def _insert(self, what: str, coll: AsyncCollection[Doc], doc: Doc) -> bool:
        """Create-only insert: False if the id exists. A duplicate met by a *retried* attempt
        whose stored document equals ours is our first attempt, which landed."""
        tries = 0

        async def op() -> bool:
            nonlocal tries
            tries += 1
            try:
                await coll.insert_one(dict(doc))
            except DuplicateKeyError:
                return tries > 1 and await coll.find_one({"_id": doc["_id"]}) == doc
            return True

        return await self._io(what, op)

    async def _find_one_and_update(
        self,
        what: str,
        coll: AsyncCollection[Doc],
        filter: Mapping[str, Any],
        update: Mapping[str, Any],
        *,
        upsert: bool = False,
    ) -> tuple[Doc | None, bool]:
        """The new document (None: no match) and whether the call was retried."""
        tries = 0

        async def op() -> Doc | None:
            nonlocal tries
            tries += 1
            return await coll.find_one_and_update(
                filter, update, upsert=upsert, return_document=ReturnDocument.AFTER
            )

        return await self._io(what, op), tries > 1

    async def ensure_indexes(self) -> None:
        """Idempotent (same specs each time), so every process may run it at start."""
        specs: list[tuple[AsyncCollection[Doc], list[tuple[str, int]], bool]] = [
            (self._runs, [("status", ASCENDING)], False),
            (self._runs, [("tenant", ASCENDING)], False),
            (self._runs, [("lease.expires_at", ASCENDING)], False),
            (self._runs, [("created_at", ASCENDING)], False),
            (self._events, [("run_id", ASCENDING), ("seq", ASCENDING)], True),
            (self._interactions, [("run_id", ASCENDING)], False),
            (self._staged, [("created_at", ASCENDING)], False),
            (self._locks, [("expires_at", ASCENDING)], False),
        ]
        for coll, keys, unique in specs:
            await self._call("create index", coll.create_index, keys, unique=unique)
        self._indexed = True

    async def ping(self) -> None:
        await self._call("ping", self._db.command, "ping")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    # -- runs -------------------------------------------------------------------------------

    def _run(self, raw: Doc) -> RunDocument:
        return decode(RunDocument, raw, what="run", ident=str(raw.get("_id")))

    async def create_run(
        self, doc: RunDocument, *, first_event: EventDraft | None = None
    ) -> RunDocument:
        if not await self._insert("create run", self._runs, {**encode(doc), "_id": doc.run_id}):
            raise RunAlreadyExists(f"run {doc.run_id!r} already exists")
        if first_event is not None:  # single-document operations: the append follows
            await self.append_event(
                doc.run_id,
                first_event.type,
                first_event.data,
                attempt=first_event.attempt,
                execution=first_event.execution,
            )
        return doc

    async def get_run(self, run_id: str) -> RunDocument:
        raw = await self._io("get run", self._runs.find_one, {"_id": run_id})
        if raw is None:
            raise RunNotFound(f"no run {run_id!r}")
        return self._run(raw)

    async def update_run(
        self, run_id: str, conditions: Sequence[Condition], update: Update
    ) -> RunDocument | CasConflict:
        """Judge on a fresh read, validate the result, then write only if the document is still
        the version judged (and the conditions still hold, for writes that skip the version).

        The pre-read is what keeps an invalid document (a misspelt nested path) from ever being
        stored: MongoDB would apply it blindly. Losing to a concurrent write re-judges.
        """
        check_update(conditions, update)
        now_ms = to_ms(utcnow())
        stored = Update(
            set={path: _storage(value) for path, value in update.set.items()},
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
            decode(RunDocument, new, what="run update", ident=run_id)  # refuse before writing
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
        if query.after_run_id is not None:
            clauses.append({"_id": {"$gt": query.after_run_id}})
        flt: Doc = {"$and": clauses} if clauses else {}
        raws = await self._find("list runs", self._runs, flt, [("_id", ASCENDING)], query.limit)
        runs = [self._run(raw) for raw in raws]
        full = query.limit > 0 and len(runs) == query.limit
        return RunPage(runs=runs, next_after=runs[-1].run_id if full else None)

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
        self._recent.pop(run_id, None)
        await self._io("delete events", self._events.delete_many, {"run_id": run_id})
        await self._io("delete interactions", self._interactions.delete_many, {"run_id": run_id})
        result = await self._io("delete run", self._runs.delete_one, {"_id": run_id})
        return result.deleted_count > 0

    # -- events -----------------------------------------------------------------------------

    async def append_event(
        self,
        run_id: str,
        type: str,
        data: dict[str, Any] | None = None,
        *,
        attempt: int | None = None,
        execution: str | None = None,
    ) -> Event:
        """No counter document: the unique `(run_id, seq)` index arbitrates between processes;
        within this process appends to one run queue on a lock (FIFO, so none starves).

        The first try uses the last seq this process saw for the run (one round trip when one
        execution appends to its own run); a collision falls back to reading `max(seq)`. A
        remembered seq always exists (events go only with their run, and run ids are never
        reused), so the guess never leaves a gap. The `_id` is fixed per call so a retried insert
        that landed is found, not appended twice."""
        recent = self._recent_run(run_id)
        event_id, at = uuid.uuid4().hex, utcnow()
        async with recent.lock:
            for _ in range(_APPEND_TRIES):
                if recent.last_seq is None:
                    flt, order = {"run_id": run_id}, [("seq", DESCENDING)]
                    top = await self._find("read max seq", self._events, flt, order, 1, _SEQ_ONLY)
                    recent.last_seq = int(top[0]["seq"]) if top else 0
                event = Event(
                    run_id=run_id,
                    seq=recent.last_seq + 1,
                    type=type,
                    attempt=attempt,
                    execution=execution,
                    at=at,
                    data=data or {},
                )
                doc = {**encode(event), "_id": event_id}
                try:
                    await self._io("append event", self._events.insert_one, doc)
                except DuplicateKeyError:
                    mine = await self._io("re-read event", self._events.find_one, {"_id": event_id})
                    if mine is None:
                        recent.last_seq = None
                        continue
                    event = self._event(mine)
                recent.last_seq = event.seq
                return event
        raise StoreUnavailable(
            f"{self._label}: event append for run {run_id!r} lost {_APPEND_TRIES} races in a row"
        )

    def _recent_run(self, run_id: str) -> _RecentRun:
        """LRU-bounded; evicting a run that is still appending costs only a collision."""
        recent = self._recent.pop(run_id, None) or _RecentRun()
        self._recent[run_id] = recent
        if len(self._recent) > _RECENT_RUNS:
            self._recent.popitem(last=False)
        return recent

    def _event(self, raw: Doc) -> Event:
        ident = f"{raw.get('run_id')}#{raw.get('seq')}"
        return decode(Event, raw, what="event", ident=ident)

    async def read_events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]:
        flt = {"run_id": run_id, "seq": {"$gt": after_seq}}
        raws = await self._find("read events", self._events, flt, [("seq", ASCENDING)], limit)
        return [self._event(raw) for raw in raws]

    # -- interactions -----------------------------------------------------------------------

    def _interaction(self, raw: Doc) -> Interaction:
        return decode(Interaction, raw, what="interaction", ident=str(raw.get("_id")))

    async def put_interaction(self, interaction: Interaction) -> Interaction:
        doc = {**encode(interaction), "_id": interaction.id}
        if await self._insert("put interaction", self._interactions, doc):
            return interaction
        raw = await self._io("get interaction", self._interactions.find_one, {"_id": doc["_id"]})
        if raw is None:  # deleted between our insert and this read (`gc`): it was there
            return interaction
        return self._interaction(raw)

    async def answer_interaction(
        self, interaction_id: str, answers: dict[str, Any], at: datetime
    ) -> Interaction | None:
        sets = {
            "status": InteractionStatus.ANSWERED.value,
            "answers": _storage(answers),
            "answered_at": to_ms(at),
        }
        flt = {"_id": interaction_id, "status": _PENDING}
        raw, retried = await self._find_one_and_update(
            "answer interaction", self._interactions, flt, {"$set": sets}
        )
        if raw is None and retried:  # our first attempt may have landed
            raw = await self._io("re-read", self._interactions.find_one, {"_id": interaction_id})
            if raw is None or any(raw.get(k) != v for k, v in sets.items()):
                return None
        return None if raw is None else self._interaction(raw)

    async def retire_interactions(self, run_id: str) -> int:
        """One `update_one` per interaction (no `update_many` in the mongomock-served subset)."""
        pending = await self._find(
            "list pending", self._interactions, {"run_id": run_id, "status": _PENDING}, []
        )
        retired = 0
        for raw in pending:
            result = await self._io(
                "retire interaction",
                self._interactions.update_one,
                {"_id": raw["_id"], "status": _PENDING},
                {"$set": {"status": InteractionStatus.RETIRED.value}},
            )
            retired += result.modified_count
        return retired

    async def list_interactions(
        self, run_id: str, *, pending_only: bool = False
    ) -> list[Interaction]:
        flt: Doc = {"run_id": run_id, **({"status": _PENDING} if pending_only else {})}
        order = [("created_at", ASCENDING), ("_id", ASCENDING)]
        raws = await self._find("list interactions", self._interactions, flt, order)
        return [self._interaction(raw) for raw in raws]

    # -- staged uploads ---------------------------------------------------------------------

    def _staged_upload(self, raw: Doc) -> StagedUpload:
        return decode(StagedUpload, raw, what="staged upload", ident=str(raw.get("_id")))

    async def put_staged_upload(self, record: StagedUpload) -> None:
        doc = {**encode(record), "_id": record.id}
        if not await self._insert("put staged upload", self._staged, doc):
            raise RunAlreadyExists(f"staged upload {record.id!r} already exists")

    async def get_staged_upload(self, upload_id: str, tenant: str) -> StagedUpload | None:
        flt = {"_id": upload_id, "tenant": tenant}
        raw = await self._io("get staged upload", self._staged.find_one, flt)
        return None if raw is None else self._staged_upload(raw)

    async def delete_staged_upload(self, upload_id: str, tenant: str) -> bool:
        flt = {"_id": upload_id, "tenant": tenant}
        result = await self._io("delete staged upload", self._staged.delete_one, flt)
        return result.deleted_count > 0

    async def list_staged_uploads_before(
        self, cutoff: datetime, limit: int = 100
    ) -> list[StagedUpload]:
        flt = {"created_at": {"$lt": to_ms(cutoff)}}
        order = [("created_at", ASCENDING), ("_id", ASCENDING)]
        raws = await self._find("list staged uploads", self._staged, flt, order, limit)
        return [self._staged_upload(raw) for raw in raws]

    # -- locks ------------------------------------------------------------------------------

    async def try_lock(self, name: str, owner: str, now: datetime, ttl_s: float) -> bool:
        """One upsert: it matches only a lock that is ours or expired; when the lock exists and
        is held by another, the upsert's insert collides on `_id` and that is the refusal."""
        now_ms = to_ms(now)
        record = LockRecord(name=name, owner=owner, expires_at=now + timedelta(seconds=ttl_s))
        flt = {"_id": name, "$or": [{"owner": owner}, {"expires_at": {"$lte": now_ms}}]}
        try:
            await self._find_one_and_update(
                "take lock", self._locks, flt, {"$set": encode(record)}, upsert=True
            )
        except DuplicateKeyError:
            return False
        return True
