"""A run between automatic retries (SPEC §5.5, §6.6): `failed_resumable` with an auto-resumable
code, its message nak'd with a delay, the next delivery on its way. To an operator it must look
alive — "retry in 14 s (delivery 3 of 10, TOOL_FAILED_TRANSIENT)" — not failed.

What is known comes from the run's last `run_retry_scheduled` event (`delay`, the `delivery` that
failed, SPEC §6.3) and the consumer's `max_deliver` (the settings the fleet and the consumer
agree on, SPEC §3); nothing here asks NATS.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from pydantic import ValidationError

from engine.failures import is_auto_resumable
from runner.operations.env import Env
from store import Event, Origin, RunDocument, RunfleetError, RunStatus, RunStore, utcnow
from store.events import events_newest_first
from store.timeutil import iso_z


def will_retry(doc: RunDocument) -> bool:
    """Whether the fleet's machinery (redelivery, the sweeper) will pick this run up again by
    itself: a `fleet` run `failed_resumable` with an auto-resumable code."""
    return (
        doc.origin is Origin.FLEET
        and doc.status is RunStatus.FAILED_RESUMABLE
        and is_auto_resumable(doc.failure_code)
    )


@dataclass(frozen=True, slots=True)
class RetryWait:
    code: str
    due_at: datetime
    """When the nak delay runs out and the next delivery can come."""
    next_delivery: int
    max_deliver: int | None
    """The consumer's `max_deliver`, when the settings could be read."""

    def seconds_left(self, now: datetime | None = None) -> float:
        return max(0.0, (self.due_at - (now or utcnow())).total_seconds())

    def describe(self, now: datetime | None = None) -> str:
        left = self.seconds_left(now)
        when = f"retry in {left:.0f} s" if left >= 0.5 else "retry due now"
        of = f" of {self.max_deliver}" if self.max_deliver else ""
        return f"{when} (delivery {self.next_delivery}{of}, {self.code})"

    def to_dict(self, now: datetime | None = None) -> dict[str, object]:
        return {
            "code": self.code,
            "due_at": iso_z(self.due_at),
            "seconds_left": round(self.seconds_left(now), 1),
            "next_delivery": self.next_delivery,
            "max_deliver": self.max_deliver,
        }


async def last_retry_scheduled(store: RunStore, doc: RunDocument) -> Event | None:
    """The run's `run_retry_scheduled` event since its last claim, if it has one (a run the
    sweeper failed `RUNNER_LOST` after a claim has none: no delay is known for it)."""
    async for event in events_newest_first(store, doc.run_id):
        if event.type == "run_claimed":
            return None  # read back to the last claim: no schedule since (an earlier is spent)
        if event.type == "run_retry_scheduled" and event.attempt in (None, doc.attempt):
            return event
    return None


async def retry_wait(
    store: RunStore, doc: RunDocument, max_deliver: int | None
) -> RetryWait | None:
    """The retry `doc` is waiting for, or None when it is not waiting for one."""
    if not will_retry(doc):
        return None
    event = await last_retry_scheduled(store, doc)
    if event is None:
        return None
    delay = float(event.data.get("delay") or 0.0)
    delivery = int(event.data.get("delivery") or 0)
    return RetryWait(
        code=str(event.data.get("code") or doc.failure_code),
        due_at=event.at + timedelta(seconds=delay),
        next_delivery=delivery + 1,
        max_deliver=max_deliver,
    )


async def waiting_retry(env: Env, doc: RunDocument) -> RetryWait | None:
    """`retry_wait` with the consumer's `max_deliver` from the wire settings; a wire setting
    that does not read leaves it out rather than failing a read-only `status`."""
    if not will_retry(doc):
        return None
    try:
        max_deliver: int | None = env.wire().max_deliver
    except (RunfleetError, ValidationError):
        max_deliver = None
    return await retry_wait(env.store, doc, max_deliver)
