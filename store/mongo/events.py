"""Events on MongoDB (SPEC §6.3): gap-free sequences per run without a counter document."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

from pymongo import ASCENDING, DESCENDING
from pymongo.errors import BulkWriteError, DuplicateKeyError

from store.codec import decode, encode
from store.errors import StoreUnavailable
from store.events import AppendsDrafts
from store.models import Event
from store.mongo.connection import Doc, MongoConnection
from store.protocols import EventDraft
from store.timeutil import from_ms, to_ms

PENDING = "_pending_events"
"""A write's events, in its run document, written by the same single-document operation as
the state they describe, until they are copied to `events` (SPEC §6.3 on MongoDB, which has
no transaction here): the document and an `insert_many` after it lost the events of a process
that died between the two, or whose `insert_many` failed (a Mongo store review). Kept out of
the `RunDocument` (`state_of`)."""

_APPEND_TRIES = 200
_SEQ_ONLY = {"_id": 0, "seq": 1}
"""Covered by the `(run_id, seq)` index on a real server; spares mongomock copying each event."""


class MongoEvents(AppendsDrafts, MongoConnection):
    async def _append_draft(
        self, run_id: str, draft: EventDraft, at: datetime, event_id: str | None = None
    ) -> Event:
        """The unique `(run_id, seq)` index arbitrates between processes; within this process
        appends to one run queue on a lock (FIFO, so none starves).

        The first try uses the last seq this process saw for the run (one round trip when one
        execution appends to its own run); a collision falls back to reading `max(seq)`. A
        remembered seq always exists (events go only with their run, and run ids are never
        reused), so the guess never leaves a gap. The `_id` is fixed per call so a retried insert
        that landed is found, not appended twice."""
        recent = self._recent.get(run_id)
        event_id = event_id or uuid.uuid4().hex
        async with recent.lock:
            for _ in range(_APPEND_TRIES):
                if recent.last_seq is None:
                    flt, order = {"run_id": run_id}, [("seq", DESCENDING)]
                    top = await self._find("read max seq", self._events, flt, order, 1, _SEQ_ONLY)
                    recent.last_seq = int(top[0]["seq"]) if top else 0
                event = draft.event(run_id, recent.last_seq + 1, at)
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

    async def _append_entries(self, run_id: str, entries: Sequence[Doc]) -> None:
        """Several events (`pending_entries`) in one `insert_many` (ordered), numbered from the
        last seq this process saw. A collision (another process appended meanwhile, or an entry
        landed before: a retry, a flush after a crash) stops the ordered insert; the entries
        that did not land then go one by one through `_append_draft`, which re-reads
        `max(seq)`: still gap-free and in order. Each entry's `_id` is fixed, so one that
        landed is found, never appended twice."""
        if len(entries) == 1:
            await self._append_entry(run_id, entries[0])
            return
        recent = self._recent.get(run_id)
        ids = [str(entry["id"]) for entry in entries]
        if entries:
            async with recent.lock:
                if recent.last_seq is None:
                    flt, order = {"run_id": run_id}, [("seq", DESCENDING)]
                    top = await self._find("read max seq", self._events, flt, order, 1, _SEQ_ONLY)
                    recent.last_seq = int(top[0]["seq"]) if top else 0
                first = recent.last_seq + 1
                docs = [_event_doc(run_id, first + i, entry) for i, entry in enumerate(entries)]
                try:
                    await self._io("append events", self._events.insert_many, docs)
                except BaseException as exc:
                    recent.last_seq = None  # whatever landed, the next append reads max(seq)
                    if not isinstance(exc, BulkWriteError | DuplicateKeyError):
                        raise
                else:
                    recent.last_seq = first + len(entries) - 1
                    return
        landed = {
            raw["_id"]
            for raw in await self._find(
                "re-read events", self._events, {"_id": {"$in": ids}}, [], len(ids)
            )
        }
        for entry in entries:
            if entry["id"] not in landed:
                await self._append_entry(run_id, entry)

    async def _append_entry(self, run_id: str, entry: Doc) -> None:
        draft = EventDraft(str(entry["type"]), entry["data"], entry["attempt"], entry["execution"])
        await self._append_draft(run_id, draft, from_ms(entry["at"]), str(entry["id"]))

    async def _flush_pending(self, run_id: str, entries: Sequence[Doc]) -> None:
        """Copy a write's events (`PENDING` in its run document) to `events`, then drop them
        from the document. Run by the write itself, and by whoever next writes the run or
        reads its events when the writer died in between (`flush_left`)."""
        if not entries:
            return
        await self._append_entries(run_id, entries)
        ids = [entry["id"] for entry in entries]
        pull = {"$pull": {PENDING: {"id": {"$in": ids}}}}
        await self._io("clear pending events", self._runs.update_one, {"_id": run_id}, pull)

    async def flush_left(self, run_id: str) -> None:
        """Events a dead writer left in the run document, copied before anything reads or
        writes after them."""
        raw = await self._io(
            "read pending events", self._runs.find_one, {"_id": run_id}, {PENDING: 1}
        )
        if raw and raw.get(PENDING):
            await self._flush_pending(run_id, raw[PENDING])

    def _event(self, raw: Doc) -> Event:
        ident = f"{raw.get('run_id')}#{raw.get('seq')}"
        return decode(Event, raw, what="event", ident=ident)

    async def read_events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]:
        await self.flush_left(run_id)
        flt = {"run_id": run_id, "seq": {"$gt": after_seq}}
        raws = await self._find("read events", self._events, flt, [("seq", ASCENDING)], limit)
        return [self._event(raw) for raw in raws]


def pending_entries(drafts: Sequence[EventDraft], at: datetime) -> list[Doc]:
    """`drafts` in storage form with their `_id`s fixed, to ride in the run document."""
    at_ms = to_ms(at)
    return [
        {"id": uuid.uuid4().hex, **_without_place(draft.stored("", 0, at_ms))} for draft in drafts
    ]


def _without_place(stored: Doc) -> Doc:
    return {k: v for k, v in stored.items() if k not in ("run_id", "seq")}


def _event_doc(run_id: str, seq: int, entry: Doc) -> Doc:
    fields = {k: v for k, v in entry.items() if k != "id"}
    return {"run_id": run_id, "seq": seq, **fields, "_id": entry["id"]}


def state_of(raw: Doc) -> Doc:
    """A stored run document without its pending events: what the `RunDocument` reads."""
    if PENDING not in raw:
        return raw
    return {k: v for k, v in raw.items() if k != PENDING}
