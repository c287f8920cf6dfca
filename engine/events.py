"""The execution's event log: every event carries the attempt and the execution (lease token)
of SPEC §6.3. Events are projections: after the lease is lost nothing more is appended."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from engine.cancel import CancelSignal
from engine.outcome import CancelReason
from store import Event, RunStore


class EventLog:
    def __init__(
        self,
        store: RunStore,
        run_id: str,
        attempt: int,
        execution: str | None,
        cancel: CancelSignal | None = None,
        listener: Callable[[Event], None] | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.attempt = attempt
        self.execution = execution
        self._cancel = cancel
        self._listener = listener
        self.deadline: Callable[[], float] | None = None
        """Seconds the lease has left (set by the lease holder): an append still pending when
        they run out is abandoned, so a stalled execution's narration cannot land after an
        adopter's claim."""

    async def emit(self, type: str, **data: Any) -> Event | None:
        if self._cancel is not None and self._cancel.reason is CancelReason.LEASE_LOST:
            return None
        append = self.store.append_event(
            self.run_id, type, data, attempt=self.attempt, execution=self.execution
        )
        if self.deadline is None:
            event = await append
        else:
            try:
                event = await asyncio.wait_for(append, timeout=max(self.deadline(), 0.001))
            except TimeoutError:
                return None
        if self._listener is not None:
            self._listener(event)
        return event
