"""After `run()` returns (SPEC §5.4 order, §5.6 table): (1) write the outcome status, fenced —
on a last delivery the DLQ record is published first; (2) teardown; (3) release the lease (or
hand off); (4) dispose of the delivery. One place maps every outcome to ack / nak(delay) / DLQ.

A runner that lost its lease (or passed the unwind ceiling) writes nothing and sends no
disposition: an ack or nak on the old delivery would act on the adopter's message.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from engine.events import EventLog
from engine.execution import Execution
from engine.failures import FailureCode, rule_for
from engine.fencing import LeaseLost
from engine.outcome import CancelReason, Failed, Interrupted, Outcome
from engine.settle import emit_status_event, status_for
from publisher.errors import DuplicatePublication, PublishFailed
from publisher.wire import RunMessage
from runner.delays import transient_delay
from runner.deliveries import Delivery
from runner.services import RunnerServices
from store import CasConflict, Eq, RunDocument, RunStatus, StoreError, Update, utcnow

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Plan:
    """What step (4) does: `ack`, `nak` (with `delay`), `handoff`, or `none` (fenced)."""

    action: str
    delay: float = 0.0
    reason: str = ""


async def dispose_outcome(
    svc: RunnerServices,
    delivery: Delivery,
    message: RunMessage,
    execution: Execution,
    events: EventLog,
    outcome: Outcome,
) -> Plan:
    plan = await _write_status(svc, delivery, execution, events, outcome)
    if plan.action == "none":
        await _teardown(svc, execution)
        return plan
    if not await _teardown(svc, execution):
        return Plan("none", reason="unwind_ceiling")
    if plan.action == "handoff":
        return await _handoff(svc, delivery, execution, events)
    await execution.writer.release()
    if plan.action == "nak":
        await delivery.nak(plan.delay)
    else:
        await delivery.ack()
    return plan


async def _teardown(svc: RunnerServices, execution: Execution) -> bool:
    """Stop the sandbox (and bank, with remote drivers) within the teardown budget. Past it the
    execution gives up its claim to write: it is fenced like a lost lease."""
    try:
        await asyncio.wait_for(execution.teardown(), svc.engine.teardown_budget.total_seconds())
        return True
    except TimeoutError:
        log.error("run %s: teardown passed its budget; fenced", execution.run_id)
        execution.cancel.cancel(CancelReason.LEASE_LOST)
        return False


async def _write_status(
    svc: RunnerServices,
    delivery: Delivery,
    execution: Execution,
    events: EventLog,
    outcome: Outcome,
) -> Plan:
    writer = execution.writer
    settlement = status_for(outcome)
    if settlement is None:
        return Plan("none", reason="lease_lost")
    info = delivery.info
    try:
        if isinstance(outcome, Interrupted):  # a drain: RUNNER_INTERRUPTED, then hand off
            doc = await writer.write_status(
                settlement.status, failure_code=settlement.failure_code, error=settlement.error
            )
            if doc.status is RunStatus.CANCELLED:
                await events.emit("run_cancelled")
                return Plan("ack", reason="cancelled")
            return Plan("handoff", reason="drain")
        if isinstance(outcome, Failed):
            rule = rule_for(outcome.code, bot_resumable=outcome.resumable)
            if rule.transient and not outcome.deliberate:
                return await _transient(svc, delivery, execution, events, outcome)
            doc = await writer.write_status(
                settlement.status, failure_code=settlement.failure_code, error=settlement.error
            )
            await emit_status_event(events, doc, outcome)
            if doc.status is not RunStatus.CANCELLED:
                reason = "deliberate" if outcome.deliberate else str(rule.klass)
                await events.emit("run_retry_skipped", reason=reason, code=outcome.code)
            return Plan("ack", reason=reason_for(doc))
        doc = await writer.write_status(
            settlement.status, failure_code=settlement.failure_code, error=settlement.error
        )
        await emit_status_event(events, doc, outcome)
        return Plan("ack", reason=reason_for(doc))
    except LeaseLost:
        return Plan("none", reason="lease_lost")
    except StoreError as exc:
        log.warning("run %s: store unreachable at the status write (%s)", execution.run_id, exc)
        delay = transient_delay(
            FailureCode.INTERNAL_ERROR,
            info.num_delivered,
            svc.settings.transient_delay,
            svc.settings.transient_delay_cap,
        )
        return Plan("nak", delay, reason="store_unreachable")


def reason_for(doc: RunDocument) -> str:
    return str(doc.status)


async def _transient(
    svc: RunnerServices,
    delivery: Delivery,
    execution: Execution,
    events: EventLog,
    outcome: Failed,
) -> Plan:
    writer = execution.writer
    info = delivery.info
    if info.is_last:
        # The record first (awaited), then the park: a crash in between leaves a record and a
        # run the backstop parks; never a park without a record.
        record = await svc.dlq.put(
            seq=info.stream_seq,
            body=delivery.data,
            headers=delivery.headers,
            reason="retries_exhausted",
            detail=f"{outcome.code}: {outcome.error}",
            run_id=execution.run_id,
            attempt=execution.run_doc.attempt,
            num_delivered=info.num_delivered,
            runner=svc.owner,
        )
        svc.metrics.dlq_records.labels(reason=record.reason).inc()
        doc = await writer.write_status(
            RunStatus.FAILED_RESUMABLE,
            failure_code=FailureCode.DLQ_PARKED,
            error=outcome.error,
            cause_code=outcome.code,
        )
        if doc.status is RunStatus.CANCELLED:
            await events.emit("run_cancelled")
        else:
            await events.emit("run_dlq_parked", reason=record.reason, record_id=record.id)
        return Plan("ack", reason="dlq_parked")
    delay = transient_delay(
        outcome.code,
        info.num_delivered,
        svc.settings.transient_delay,
        svc.settings.transient_delay_cap,
    )
    doc = await writer.write_status(
        RunStatus.FAILED_RESUMABLE, failure_code=outcome.code, error=outcome.error
    )
    if doc.status is RunStatus.CANCELLED:
        await events.emit("run_cancelled")
        return Plan("ack", reason="cancelled")
    await events.emit(
        "run_retry_scheduled", code=outcome.code, delay=delay, delivery=info.num_delivered
    )
    return Plan("nak", delay, reason="transient")


async def _handoff(
    svc: RunnerServices, delivery: Delivery, execution: Execution, events: EventLog
) -> Plan:
    """The drain's handoff (SPEC §5.6): one CAS releases the lease and bumps the attempt, so the
    next execution is a new attempt that spends no delivery budget; then publish it, record it,
    and `ack_sync` the old delivery. A crash in between is repaired by the sweeper."""
    writer = execution.writer
    run_id = execution.run_id
    attempt = execution.run_doc.attempt
    result = await svc.store.update_run(
        run_id,
        [
            Eq("lease.token", writer.token),
            Eq("attempt", attempt),
            Eq("status", RunStatus.FAILED_RESUMABLE),
            Eq("failure_code", FailureCode.RUNNER_INTERRUPTED),
        ],
        Update(set={"attempt": attempt + 1, "attempt_at": utcnow()}, unset=["lease"]),
    )
    if isinstance(result, CasConflict):
        current = result.current
        if current is None or current.lease is None or current.lease.token != writer.token:
            # Not an operator: the lease itself is gone, and the delivery is the adopter's.
            execution.cancel.cancel(CancelReason.LEASE_LOST)
            return Plan("none", reason="lease_lost")
        await writer.release()  # an operator acted in between: a plain release
        await delivery.ack_sync()
        return Plan("ack", reason="handoff_superseded")
    try:
        ack = await svc.publisher.publish(result, "handoff")
        await svc.publisher.record_publication(result, ack)
        await svc.store.append_event(
            run_id, "run_queued", {"attempt": attempt + 1, "kind": "handoff"}, attempt=attempt + 1
        )
    except (PublishFailed, DuplicatePublication, StoreError) as exc:
        log.warning("run %s: handoff publish failed (%s); the sweeper republishes", run_id, exc)
    await delivery.ack_sync()
    return Plan("handoff", reason="drain")
