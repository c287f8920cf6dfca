"""The MongoDB connection under every `MongoRunStore` operation: the collections, bounded
retries with error translation, and the indexes the store's guarantees rest on (ADR-0002).

Transient driver errors are retried (bounded) and then become `StoreUnavailable`; any other driver
error becomes `StoreError`. A retried write may already have landed before its connection dropped
(a standalone `mongod` has no retryable writes), so the write helpers report whether they were
retried and each operation recognises its own earlier attempt.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ParamSpec, Self, TypeVar

from bson.errors import BSONError
from pymongo import ASCENDING, AsyncMongoClient, ReadPreference, ReturnDocument
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import (
    BulkWriteError,
    ConnectionFailure,
    DuplicateKeyError,
    OperationFailure,
    PyMongoError,
    WriteConcernError,
)
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from store.errors import InvalidStoreUrl, StoreError, StoreUnavailable
from store.mongo.recent import RecentRuns

P = ParamSpec("P")
T = TypeVar("T")
Doc = dict[str, Any]

_TRANSIENT = (ConnectionFailure,)
"""AutoReconnect, NetworkTimeout and ServerSelectionTimeoutError all derive from it."""

DURABLE: dict[str, Any] = {
    "write_concern": WriteConcern("majority", j=True),
    "read_concern": ReadConcern(),
    "read_preference": ReadPreference.PRIMARY,
}
"""What the store's guarantees need, whatever the URL asks: a claim, a lease or an event
acknowledged by a majority survives a failover (under w:1 a rolled-back create lost its run
and a rolled-back claim ran a run twice), and every read that feeds a compare-and-set goes to
the primary (a `readPreference=secondary` in the URL fed stale documents to the CAS). Reads
take the server's default read concern (`local`), whatever the URL asks: a `majority` one
kept the CAS's pre-read on the version before a write not yet majority-committed, and its 50
tries ended in a conflict that read as a lost lease (a review); the version check fences the
write either way. On a
single `mongod` a majority is that server. A Mongo store review, docs/deploy.md."""


def durable_database(client: AsyncMongoClient[Doc], name: str | None) -> AsyncDatabase[Doc]:
    """The database `name` (else the URL's, else `runfleet`) with `DURABLE`'s options."""
    return client.get_database(name or client.get_default_database("runfleet").name, **DURABLE)


DUPLICATE_KEY = 11000

_UNAVAILABLE_CODES = frozenset({6, 7, 89, 91, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436})
"""Server errors that mean "not now" (host unreachable or not found, a network timeout, shutting
down, an election in progress, not primary), as PyMongo's own retryable-error list: an
operator's command is exit 4 and the API 503, not a store fault (a Mongo store review)."""


def is_duplicate_only(exc: BulkWriteError) -> bool:
    """Every write error of a bulk insert is a duplicate key: another writer (or our own
    earlier attempt) got there first, which the caller decides about, as for one insert."""
    errors = exc.details.get("writeErrors") or []
    return bool(errors) and all(e.get("code") == DUPLICATE_KEY for e in errors)


def is_unavailable(exc: PyMongoError) -> bool:
    """A failure the server would not have made in calmer times: no primary, an election,
    a write concern not met (its outcome unknown), a retryable label."""
    if isinstance(exc, WriteConcernError):
        return True
    if exc.has_error_label("RetryableWriteError") or exc.has_error_label("ResetPool"):
        return True
    return isinstance(exc, OperationFailure) and exc.code in _UNAVAILABLE_CODES


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


class MongoConnection:
    """Pass a database (tests pass a mongomock-motor one) or `connect()`."""

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
        self._index_lock = asyncio.Lock()
        self._recent = RecentRuns()

    @classmethod
    async def connect(
        cls,
        url: str,
        db_name: str | None = None,
        *,
        server_selection_timeout_ms: int = 5000,
        retry_attempts: int = 5,
    ) -> Self:
        """Open, ping and index, so a wrong URL fails at start with the (redacted) URL named."""
        shown = redact_url(url)
        try:
            client: AsyncMongoClient[Doc] = AsyncMongoClient(
                url, tz_aware=True, serverSelectionTimeoutMS=server_selection_timeout_ms
            )
            db = durable_database(client, db_name)
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

    async def _call(
        self, what: str, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run one driver call with bounded retries; translate what escapes into our errors.

        `DuplicateKeyError`, and a `BulkWriteError` made only of duplicate keys, pass through
        untranslated: callers decide what a duplicate means. (The bulk one was translated to
        `StoreError`, so an `insert_many` of events that met another process's append never
        reached its recovery; a Mongo store review.)
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
        except BulkWriteError as exc:
            if is_duplicate_only(exc):
                raise
            raise self._translated(what, exc) from exc
        except _TRANSIENT as exc:
            raise StoreUnavailable(
                f"{self._label} unreachable during {what}: {_brief(exc)}"
            ) from exc
        except PyMongoError as exc:
            raise self._translated(what, exc) from exc
        except BSONError as exc:
            raise StoreError(f"{self._label} failed during {what}: {_brief(exc)}") from exc
        raise AssertionError("tenacity stopped without a result")  # pragma: no cover

    def _translated(self, what: str, exc: PyMongoError) -> StoreError:
        if is_unavailable(exc):
            return StoreUnavailable(f"{self._label} unavailable during {what}: {_brief(exc)}")
        return StoreError(f"{self._label} failed during {what}: {_brief(exc)}")

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
            # Listings page by `_id` under a status or tenant filter (the sweeper, `gc`, `runs`,
            # the console): without these a page of 1M runs sorted them all (a store review).
            (self._runs, [("status", ASCENDING), ("_id", ASCENDING)], False),
            (self._runs, [("tenant", ASCENDING), ("_id", ASCENDING)], False),
            (self._runs, [("tenant", ASCENDING), ("status", ASCENDING), ("_id", ASCENDING)], False),
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
