"""From an `Outcome` to the status written at step (1) of SPEC §5.4, and its event.

The runner uses `status_for` and adds what only it knows (a last delivery parks `DLQ_PARKED`);
local executions call `settle` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.events import EventLog
from engine.failures import FailureCode, rule_for
from engine.fencing import FencedWriter
from engine.outcome import (
    Cancelled,
    CancelReason,
    Failed,
    Finished,
    Interrupted,
    Outcome,
    Paused,
)
from store import EventDraft, RunDocument, RunStatus


@dataclass(frozen=True, slots=True)
class Settlement:
    status: RunStatus
    failure_code: str | None = None
    error: str | None = None


def status_for(outcome: Outcome) -> Settlement | None:
    """The status an outcome writes; None when nothing may be written (lease lost)."""
    match outcome:
        case Finished():
            return Settlement(RunStatus.FINISHED)
        case Paused(kind="human"):
            return Settlement(RunStatus.PAUSED_WAITING_HUMAN)
        case Paused(kind="budget", detail=detail):
            return Settlement(RunStatus.PAUSED_OPERATOR, FailureCode.BUDGET_EXCEEDED, detail)
        case Paused():
            return Settlement(RunStatus.PAUSED_OPERATOR)
        case Failed(code=code, error=error, resumable=resumable):
            return Settlement(rule_for(code, bot_resumable=resumable).status, code, error)
        case Cancelled():
            return Settlement(RunStatus.CANCELLED)
        case Interrupted(reason=CancelReason.LEASE_LOST):
            return None
        case Interrupted():
            return Settlement(
                RunStatus.FAILED_RESUMABLE,
                FailureCode.RUNNER_INTERRUPTED,
                "the runner was stopped (drain); the run is handed off",
            )
    raise AssertionError(f"unknown outcome {outcome!r}")


def status_event(
    events: EventLog,
    status: RunStatus,
    outcome: Outcome,
    failure_code: str | None,
    error: str | None,
) -> EventDraft:
    """The event a status write says (SPEC §6.3), to ride with it. `cancelled` is the writer's
    own (a pending cancel that beat the outcome carries `run_cancelled` instead)."""
    match status:
        case RunStatus.FINISHED:
            return events.draft("run_finished")
        case RunStatus.CANCELLED:
            return events.draft("run_cancelled")
        case RunStatus.PAUSED_WAITING_HUMAN | RunStatus.PAUSED_OPERATOR:
            kind = outcome.kind if isinstance(outcome, Paused) else "operator"
            return events.draft("run_paused", kind=kind, code=failure_code)
        case _:
            data: dict[str, object] = {"code": failure_code, "error": error}
            if isinstance(outcome, Failed) and outcome.warning:
                data["warning"] = outcome.warning
            return events.draft("run_failed", **data)


async def write_settlement(
    writer: FencedWriter,
    events: EventLog,
    settlement: Settlement,
    outcome: Outcome,
    *,
    also: Sequence[EventDraft] = (),
    release: bool = False,
) -> RunDocument:
    """The outcome's status (fenced) with its event, then `also`, in the same write. A pending
    operator cancel beats every outcome but `finished` (the writer then writes `cancelled`,
    with `run_cancelled` alone)."""
    code, error = settlement.failure_code, settlement.error
    said = status_event(events, settlement.status, outcome, code, error)
    return await writer.write_status(
        settlement.status, failure_code=code, error=error, events=[said, *also], release=release
    )


async def settle(writer: FencedWriter, events: EventLog, outcome: Outcome) -> RunDocument | None:
    """Write the outcome's status and its event (local executions)."""
    settlement = status_for(outcome)
    if settlement is None:
        return None
    return await write_settlement(writer, events, settlement, outcome)
