"""From an `Outcome` to the status written at step (1) of SPEC §5.4, and its event.

The runner uses `status_for` and adds what only it knows (a last delivery parks `DLQ_PARKED`);
local executions call `settle` directly.
"""

from __future__ import annotations

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
from store import RunDocument, RunStatus


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


async def emit_status_event(events: EventLog, doc: RunDocument, outcome: Outcome) -> None:
    match doc.status:
        case RunStatus.FINISHED:
            await events.emit("run_finished")
        case RunStatus.CANCELLED:
            await events.emit("run_cancelled")
        case RunStatus.PAUSED_WAITING_HUMAN | RunStatus.PAUSED_OPERATOR:
            kind = outcome.kind if isinstance(outcome, Paused) else "operator"
            await events.emit("run_paused", kind=kind, code=doc.failure_code)
        case _:
            data: dict[str, object] = {"code": doc.failure_code, "error": doc.error}
            if isinstance(outcome, Failed) and outcome.warning:
                data["warning"] = outcome.warning
            await events.emit("run_failed", **data)


async def settle(writer: FencedWriter, events: EventLog, outcome: Outcome) -> RunDocument | None:
    """Write the outcome's status (fenced) and its event. A pending operator cancel beats every
    outcome but `finished` (the writer then writes `cancelled`)."""
    settlement = status_for(outcome)
    if settlement is None:
        return None
    doc = await writer.write_status(
        settlement.status, failure_code=settlement.failure_code, error=settlement.error
    )
    await emit_status_event(events, doc, outcome)
    return doc
