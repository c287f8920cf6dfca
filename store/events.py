"""`RunStore.append_event` once for every backend: the protocol's arguments become an
`EventDraft` stamped with its instant, and each backend appends drafts (`_append_draft`), the
same path `create_run(first_event=...)` takes. `all_events` reads a run's history in pages;
`events_newest_first` reads it backwards, for the readers after the latest event of a kind."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from store.models import Event
from store.protocols import EventDraft, RunStore
from store.timeutil import utcnow


class AppendsDrafts(ABC):
    async def append_event(
        self,
        run_id: str,
        type: str,
        data: dict[str, Any] | None = None,
        *,
        attempt: int | None = None,
        execution: str | None = None,
    ) -> Event:
        draft = EventDraft(type, data or {}, attempt, execution)
        return await self._append_draft(run_id, draft, utcnow())

    @abstractmethod
    async def _append_draft(self, run_id: str, draft: EventDraft, at: datetime) -> Event:
        """Append with `seq = max(seq) + 1`, gap-free per run (see `RunStore.append_event`)."""


async def events_newest_first(
    store: RunStore, run_id: str, *, page: int = 32, max_page: int = 1000
) -> AsyncIterator[Event]:
    """The run's events from the newest back: for a reader after the latest event of a kind,
    which most often is among the last few (a parked run's `run_dlq_parked`, the retry
    scheduled since the last claim), so a long history is not read to find it. The first page
    is small; each next one twice the last, up to `max_page`, so a reader that does go far
    back makes few round trips."""
    before: int | None = None
    size = page
    while True:
        events = await store.read_events_before(run_id, before_seq=before, limit=size)
        for event in events:
            yield event
        if len(events) < size:
            return
        before = events[-1].seq
        size = min(size * 2, max_page)


async def all_events(
    store: RunStore, run_id: str, *, after: int = 0, page: int = 1000
) -> AsyncIterator[Event]:
    """Every event of the run after seq `after`, by seq, read `page` at a time."""
    while True:
        events = await store.read_events(run_id, after_seq=after, limit=page)
        for event in events:
            yield event
        if len(events) < page:
            return
        after = events[-1].seq
