"""Repairing a settled run's missing status event (SPEC §2: projections are "repaired by
re-running the action that wrote them").

On SQLite a status and its event are one write (ADR-0014), so this never finds anything to do
there; on MongoDB the document write comes first and its events after (`insert_many`), and a
runner killed between the two leaves a run `finished` with no `run_finished`. Its redelivery
is acked as settled at admission, which is where the event is put back — only while no
execution holds the lease (release follows the events, so a free lease means the writer
finished or died), only when an execution of that attempt was claimed, and only when no event
of that kind exists for it.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from engine.failures import FailureCode
from store import RunDocument, RunStatus, RunStore, lease_is_free
from store.events import events_newest_first

_EVENT_FOR = {
    RunStatus.FINISHED: "run_finished",
    RunStatus.FAILED: "run_failed",
    RunStatus.CANCELLED: "run_cancelled",
    RunStatus.PAUSED_WAITING_HUMAN: "run_paused",
    RunStatus.PAUSED_OPERATOR: "run_paused",
    RunStatus.FAILED_RESUMABLE: "run_failed",
}


_SETTLING = frozenset(
    {
        "run_finished",
        "run_failed",
        "run_paused",
        "run_cancelled",
        "run_dlq_parked",
        "run_rewound",
        "run_requeue_failed",
    }
)
"""Events that say how a run left `running` (or was moved by an operator afterwards)."""


def status_event(run: RunDocument) -> str | None:
    if run.status is RunStatus.FAILED_RESUMABLE and run.failure_code == FailureCode.DLQ_PARKED:
        return "run_dlq_parked"
    return _EVENT_FOR.get(run.status)


async def repair_status_event(
    store: RunStore, run: RunDocument, now: datetime, skew: timedelta
) -> bool:
    """Append the settled status's event if it is missing; True when it did."""
    kind = status_event(run)
    if kind is None or not lease_is_free(run, now, skew):
        return False
    # Read back from the newest event to the run's last claim at this attempt: anything after
    # it that says how the run settled (the status's own event, or an operator's rewind /
    # flip-back, which write their own events) means there is nothing to repair. Only a status
    # an execution of this attempt reached is repaired: a resume whose publish "failed" puts
    # the run back without any execution, and a copy of it that landed later must not invent
    # an event for a status nobody reached at that attempt (no claim: nothing to repair).
    async for e in events_newest_first(store, run.run_id):
        if e.type == "run_claimed" and e.attempt == run.attempt:
            break
        if e.type in _SETTLING:
            return False
    else:
        return False
    data: dict[str, object] = {"repaired": True}
    if kind == "run_failed":
        data.update(code=run.failure_code, error=run.error)
    elif kind == "run_paused":
        data.update(
            kind="human" if run.status is RunStatus.PAUSED_WAITING_HUMAN else "operator",
            code=run.failure_code,
        )
    await store.append_event(run.run_id, kind, data, attempt=run.attempt)
    return True
