"""`RunStore.append_event` once for every backend: the protocol's arguments become an
`EventDraft` stamped with its instant, and each backend appends drafts (`_append_draft`), the
same path `create_run(first_event=...)` takes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import datetime
from typing import Any

from store.models import Event
from store.protocols import EventDraft
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
