"""Paged reads of the soak's SQLite store, for every part of the soak that reads it: the
soak's runs in some statuses (`_list`) and one run's events (`_events`), page after page.
"""

from __future__ import annotations

from typing import Any

from store import RunDocument, RunQuery, RunStatus
from store.sqlite import SqliteRunStore
from tests.soak.config import TENANT


async def _list(store: SqliteRunStore, statuses: list[RunStatus]) -> list[RunDocument]:
    out: list[RunDocument] = []
    after: str | None = None
    while True:
        page = await store.list_runs(
            RunQuery(statuses=statuses, tenant=TENANT, after_run_id=after, limit=500)
        )
        out.extend(page.runs)
        if page.next_after is None:
            return out
        after = page.next_after


async def _events(store: SqliteRunStore, run_id: str) -> list[Any]:
    events: list[Any] = []
    after = 0
    while True:
        page = await store.read_events(run_id, after_seq=after, limit=1000)
        events.extend(page)
        if len(page) < 1000:
            break
        after = page[-1].seq
    return events
