"""The execution's event log: every event carries the attempt and the execution (lease token)
of SPEC §6.3. Events are projections: after the lease is lost nothing more is appended.

Narration that describes no side effect of its own (`run_claimed`, a compute node's
`node_started`) may be *deferred*: it rides with the next fenced state write, in the same store
operation (`RunStore.update_run(events=...)`), instead of costing a write of its own — a one-node
run writes three times, not seven (issue 19 lever 1). The order of events is kept: anything
emitted directly first carries what is pending, and a deferred event never outlives the execution
(the outcome's status write carries whatever is left). Deferral is on only for fleet executions;
a local run's listener (the CLI's progress lines) sees every event as it is appended."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from engine.cancel import CancelSignal
from engine.outcome import CancelReason
from store import Event, EventDraft, RunStore


class EventLog:
    def __init__(
        self,
        store: RunStore,
        run_id: str,
        attempt: int,
        execution: str | None,
        cancel: CancelSignal | None = None,
        listener: Callable[[Event], None] | None = None,
        *,
        defer: bool = False,
        rider: Callable[[EventDraft], None] | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.attempt = attempt
        self.execution = execution
        self._cancel = cancel
        self._listener = listener
        self._defer = defer
        self._rider = rider
        """Told of each event that rode inside a state write, once that write landed (the
        runner's metrics: `listener` hears only what is appended on its own)."""
        self._pending: list[EventDraft] = []
        self.deadline: Callable[[], float] | None = None
        """Seconds the lease has left (set by the lease holder): an append still pending when
        they run out is abandoned, so a stalled execution's narration cannot land after an
        adopter's claim."""

    def draft(self, type: str, **data: Any) -> EventDraft:
        """An event of this execution, to hand to a state write (`FencedWriter`)."""
        return EventDraft(type, data, self.attempt, self.execution)

    @property
    def rides(self) -> bool:
        """Deferred narration rides inside the next state write (fleet executions); else it is
        appended right after that write lands (local runs: the listener sees each event)."""
        return self._defer

    def defer(self, type: str, **data: Any) -> None:
        """Say `type` with the next state write (or before the next direct emit)."""
        if self._cancel is None or self._cancel.reason is not CancelReason.LEASE_LOST:
            self._pending.append(self.draft(type, **data))

    def take(self, *more: EventDraft) -> list[EventDraft]:
        """What is pending, then `more`, for a state write to carry; the log forgets them (a
        write that fails gives them back with `give_back`)."""
        taken, self._pending = [*self._pending, *more], []
        return taken

    def rode(self, drafts: list[EventDraft]) -> None:
        """`drafts` landed inside a state write."""
        if self._rider is not None:
            for draft in drafts:
                self._rider(draft)

    def give_back(self, drafts: list[EventDraft]) -> None:
        """A write that carried `drafts` raised before it landed: keep them pending, in order."""
        self._pending[:0] = drafts

    async def flush(self, *more: EventDraft) -> Event | None:
        """Append what is pending, then `more`, one by one (after a write that did not carry
        them). The last event appended; None when an append was abandoned (the rest with it)."""
        last: Event | None = None
        for draft in self.take(*more):
            last = await self._append(draft)
            if last is None:
                return None
        return last

    async def emit(self, type: str, **data: Any) -> Event | None:
        if self._cancel is not None and self._cancel.reason is CancelReason.LEASE_LOST:
            return None
        # What was deferred goes first: the order is the log's.
        return await self.flush(self.draft(type, **data))

    async def _append(self, draft: EventDraft) -> Event | None:
        append = self.store.append_event(
            self.run_id, draft.type, draft.data, attempt=self.attempt, execution=self.execution
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
