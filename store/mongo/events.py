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
from store.timeutil import to_ms

_APPEND_TRIES = 200
_SEQ_ONLY = {"_id": 0, "seq": 1}
"""Covered by the `(run_id, seq)` index on a real server; spares mongomock copying each event."""


class MongoEvents(AppendsDrafts, MongoConnection):
    async def _append_draft(self, run_id: str, draft: EventDraft, at: datetime) -> Event:
        """The unique `(run_id, seq)` index arbitrates between processes; within this process
        appends to one run queue on a lock (FIFO, so none starves).

        The first try uses the last seq this process saw for the run (one round trip when one
        execution appends to its own run); a collision falls back to reading `max(seq)`. A
        remembered seq always exists (events go only with their run, and run ids are never
        reused), so the guess never leaves a gap. The `_id` is fixed per call so a retried insert
        that landed is found, not appended twice."""
        recent = self._recent.get(run_id)
        event_id = uuid.uuid4().hex
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

    async def _append_drafts(self, run_id: str, drafts: Sequence[EventDraft], at: datetime) -> None:
        """Several events in one `insert_many` (ordered), numbered from the last seq this process
        saw. A collision (another process appended meanwhile) stops the ordered insert; the
        drafts that did not land then go one by one through `_append_draft`, which re-reads
        `max(seq)`: still gap-free and in order. The `_id`s are fixed first, so a retried insert
        that landed is found, not appended twice."""
        if len(drafts) <= 1:
            for draft in drafts:
                await self._append_draft(run_id, draft, at)
            return
        recent = self._recent.get(run_id)
        ids = [uuid.uuid4().hex for _ in drafts]
        at_ms = to_ms(at)
        async with recent.lock:
            if recent.last_seq is None:
                flt, order = {"run_id": run_id}, [("seq", DESCENDING)]
                top = await self._find("read max seq", self._events, flt, order, 1, _SEQ_ONLY)
                recent.last_seq = int(top[0]["seq"]) if top else 0
            first = recent.last_seq + 1
            docs = [
                {**draft.stored(run_id, first + i, at_ms), "_id": ids[i]}
                for i, draft in enumerate(drafts)
            ]
            try:
                await self._io("append events", self._events.insert_many, docs)
            except BaseException as exc:
                recent.last_seq = None  # whatever landed, the next append reads max(seq)
                if not isinstance(exc, BulkWriteError | DuplicateKeyError):
                    raise
                landed = {
                    raw["_id"]
                    for raw in await self._find(
                        "re-read events", self._events, {"_id": {"$in": ids}}, [], len(ids)
                    )
                }
            else:
                recent.last_seq = first + len(drafts) - 1
                return
        for event_id, draft in zip(ids, drafts, strict=True):
            if event_id not in landed:
                await self._append_draft(run_id, draft, at)

    def _event(self, raw: Doc) -> Event:
        ident = f"{raw.get('run_id')}#{raw.get('seq')}"
        return decode(Event, raw, what="event", ident=ident)

    async def read_events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]:
        flt = {"run_id": run_id, "seq": {"$gt": after_seq}}
        raws = await self._find("read events", self._events, flt, [("seq", ASCENDING)], limit)
        return [self._event(raw) for raw in raws]

    async def read_events_before(
        self, run_id: str, before_seq: int | None = None, limit: int = 1000
    ) -> list[Event]:
        flt: Doc = {"run_id": run_id}
        if before_seq is not None:
            flt["seq"] = {"$lt": before_seq}
        raws = await self._find("read events", self._events, flt, [("seq", DESCENDING)], limit)
        return [self._event(raw) for raw in raws]
