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
from engine.settle import status_for, write_settlement
from publisher.wire import RunMessage
from runner.delays import transient_delay
from runner.deliveries import Delivery
from runner.handon import publish_handoff
from runner.services import RunnerServices
from store import CasConflict, Eq, RunDocument, RunStatus, Update, utcnow

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Plan:
    """What step (4) does: `ack`, `nak` (with `delay`), `handoff`, or `none` (fenced)."""

    action: str
    delay: float = 0.0
    reason: str = ""
    record_id: int | None = None
    """The DLQ record of a parked run, for the delivery log (SPEC v2.2 §10b)."""
    released: bool = False
    """The status write dropped the lease too (nothing to tear down, ADR-0014)."""


async def dispose_outcome(
    svc: RunnerServices,
    delivery: Delivery,
    message: RunMessage,
    execution: Execution,
    events: EventLog,
    outcome: Outcome,
) -> Plan:
    """Steps (1)-(4). Each step after (1) is attempted whatever the one before raised (SPEC
    v2.2 §5.1): a sandbox whose `stop` raises still gets its lease released, and a release the
    store refuses still gets its disposition (the lease then expires by itself), unless the
    lease has reached its loss margin, when an adopter may hold the run (SPEC §5.4)."""
    plan = await _write_status(svc, delivery, execution, events, outcome)
    if plan.action == "none":
        await _teardown(svc, execution)
        return plan
    if plan.released:
        # Status, events and release landed in one fenced write, and there is nothing to tear
        # down (`Execution.teardown_is_empty`): the disposition follows at once (ADR-0014).
        await _dispose(delivery, execution, plan)
        return plan
    if not await _teardown(svc, execution):
        return Plan("none", reason="unwind_ceiling")
    if execution.writer.lost:
        # The lease was lost meanwhile (e.g. the keeper gave up during the store outage that
        # refused the status): fenced, so no release and no disposition (SPEC §5.4).
        return Plan("none", reason="lease_lost")
    if plan.action == "handoff":
        return await _handoff(svc, delivery, execution, events)
    try:
        released = await execution.writer.release()
    except Exception as exc:  # noqa: BLE001 - the disposition must still go
        log.warning("run %s: release failed (%r); the lease expires", execution.run_id, exc)
        if execution.writer.cancel.lease_spent():
            # The lease may have expired already and an adopter hold the run: this delivery's
            # sequence would then be its work. Short of the loss margin nobody else can hold
            # it, and the disposition lands first; past it, fenced (SPEC §5.4; a model
            # finding, tests/model/test_protocol_replays.py).
            return Plan("none", reason="lease_lost")
    else:
        if released is None:
            # The lease was no longer ours to release: an adopter holds the run, and this
            # delivery's sequence is now its work. Fenced: no disposition (SPEC §5.4).
            return Plan("none", reason="lease_lost")
    await _dispose(delivery, execution, plan)
    return plan


async def _dispose(delivery: Delivery, execution: Execution, plan: Plan) -> None:
    try:
        if plan.action == "nak":
            await delivery.nak(plan.delay)
        else:
            await delivery.ack()
    except Exception as exc:  # noqa: BLE001 - redelivered after ack_wait, judged again
        log.warning("run %s: disposition %s not sent (%r)", execution.run_id, plan.action, exc)


async def _teardown(svc: RunnerServices, execution: Execution) -> bool:
    """Stop the sandbox (and bank, with remote drivers) within the teardown budget. Past it the
    execution gives up its claim to write: it is fenced like a lost lease. A teardown that
    raises is logged and the release still follows: the status is already written, and a
    sandbox left behind is stopped by the next claim's `stop_others` or the sweeper."""
    try:
        await asyncio.wait_for(execution.teardown(), svc.engine.teardown_budget.total_seconds())
        return True
    except TimeoutError:
        log.error("run %s: teardown passed its budget; fenced", execution.run_id)
        execution.cancel.cancel(CancelReason.LEASE_LOST)
        return False
    except Exception:
        log.exception("run %s: teardown failed; releasing anyway", execution.run_id)
        return True


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
            # `run_failed {code, error}` rides with the status, as with every failure (SPEC
            # §6.3): the history said `node_started` then `run_queued` with nothing between.
            doc = await write_settlement(writer, events, settlement, outcome)
            if doc.status is RunStatus.CANCELLED:  # `run_cancelled` rode with it
                return Plan("ack", reason="cancelled")
            return Plan("handoff", reason="drain")
        if isinstance(outcome, Failed):
            rule = rule_for(outcome.code, bot_resumable=outcome.resumable)
            if rule.transient and not outcome.deliberate:
                return await _transient(svc, delivery, execution, events, outcome)
            reason = "deliberate" if outcome.deliberate else str(rule.klass)
            skipped = events.draft("run_retry_skipped", reason=reason, code=outcome.code)
            doc = await write_settlement(writer, events, settlement, outcome, also=[skipped])
            return Plan("ack", reason=reason_for(doc))
        release = execution.teardown_is_empty()
        doc = await write_settlement(writer, events, settlement, outcome, release=release)
        return Plan("ack", reason=reason_for(doc), released=release)
    except LeaseLost:
        return Plan("none", reason="lease_lost")
    except Exception as exc:  # noqa: BLE001 - see below: an unwritten status is a nak
        # The store cannot take the status (an outage, or a write it refuses): no outcome is
        # recorded, so none is disposed of. Nak with the transient delay and no DLQ record;
        # the lease expiry and the sweeper own the run (SPEC v2.2 §5.6 last row).
        log.warning("run %s: status not written (%r)", execution.run_id, exc)
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
        return await _park(svc, delivery, execution, events, outcome)
    delay = transient_delay(
        outcome.code,
        info.num_delivered,
        svc.settings.transient_delay,
        svc.settings.transient_delay_cap,
    )
    scheduled = events.draft(
        "run_retry_scheduled", code=outcome.code, delay=delay, delivery=info.num_delivered
    )
    doc = await writer.write_status(
        RunStatus.FAILED_RESUMABLE,
        failure_code=outcome.code,
        error=outcome.error,
        events=[scheduled],
    )
    if doc.status is RunStatus.CANCELLED:  # `run_cancelled` rode instead
        return Plan("ack", reason="cancelled")
    return Plan("nak", delay, reason="transient")


async def _park(
    svc: RunnerServices,
    delivery: Delivery,
    execution: Execution,
    events: EventLog,
    outcome: Failed,
) -> Plan:
    """A transient code at the last delivery: the record first (awaited), then the park (SPEC
    §5.4 (1)). A crash in between leaves a record and an unparked run, which the backstop
    parks. A record is never left standing for a run that was not parked: when the park does
    not land (store down, lease lost) or meets an operator's cancel, the record is withdrawn —
    replaying it would un-cancel the run, or loop it through the DLQ again."""
    writer = execution.writer
    info = delivery.info
    current = await svc.store.get_run(execution.run_id)
    if current.cancel_requested:  # an operator's cancel beats the outcome: no record at all
        await writer.write_cancelled()  # `run_cancelled` rides with it
        return Plan("ack", reason="cancelled")
    try:
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
    except Exception as exc:  # noqa: BLE001 - JetStream refused it: the run must not vanish
        return await _unparkable(execution, events, outcome, exc)
    parked = events.draft("run_dlq_parked", reason=record.reason, record_id=record.id)
    try:
        doc = await writer.write_status(
            RunStatus.FAILED_RESUMABLE,
            failure_code=FailureCode.DLQ_PARKED,
            error=outcome.error,
            cause_code=outcome.code,
            events=[parked],
        )
    except BaseException:
        await _withdraw(svc, record.id)
        raise
    if doc.status is RunStatus.CANCELLED:  # `run_cancelled` rode instead
        await _withdraw(svc, record.id)
        return Plan("ack", reason="cancelled")
    svc.metrics.dlq_records.labels(reason=record.reason).inc()
    log.warning(
        "run %s: parked in the DLQ as record %s after %s deliveries (%s)",
        execution.run_id,
        record.id,
        info.num_delivered,
        outcome.code,
    )
    return Plan("ack", reason="dlq_parked", record_id=record.id)


async def _unparkable(
    execution: Execution, events: EventLog, outcome: Failed, exc: Exception
) -> Plan:
    """The last delivery's DLQ record could not be written (JetStream's disk full, found by a
    disk-full drill). The run is not left as it was: its nak would end the message's
    deliveries, the max-deliveries advisory went unstored on the same full disk, so the
    backstop never heard of it and the sweeper saw a message still there — the run stayed
    `running` with no lease for good, and `resume` refused it as running.

    So it is parked as a record would have parked it (`failed_resumable` `DLQ_PARKED`, its
    code as the cause, SPEC §5.6's last-delivery row), without the record, and a
    `run_dlq_unavailable` event says why; the delivery is acked. It waits for an operator's
    `resume` (`status` says so: "no DLQ record left"), and nothing retries it by itself: left
    auto-resumable, the sweeper republished it with a fresh set of deliveries every cycle for
    as long as the DLQ refused (a review of this fix). A store that refuses this write too is
    the nak of `_write_status`."""
    log.error(
        "run %s: its last delivery could not be dead-lettered (%r); parked DLQ_PARKED (%s)"
        " without a record: `runfleet resume` it once the cause is fixed",
        execution.run_id,
        exc,
        outcome.code,
    )
    unavailable = events.draft("run_dlq_unavailable", code=outcome.code, error=repr(exc)[:500])
    doc = await execution.writer.write_status(
        RunStatus.FAILED_RESUMABLE,
        failure_code=FailureCode.DLQ_PARKED,
        error=f"{outcome.error} (not dead-lettered: the DLQ refused its record: {exc!r})"[:2000],
        cause_code=outcome.code,
        events=[unavailable],
    )
    if doc.status is RunStatus.CANCELLED:  # `run_cancelled` rode instead
        return Plan("ack", reason="cancelled")
    return Plan("ack", reason="dlq_unavailable")


async def _withdraw(svc: RunnerServices, record_id: int) -> None:
    try:
        await svc.dlq.delete(record_id)
    except Exception as exc:  # noqa: BLE001 - the backstop and sweeper judge the run anyway
        log.warning("DLQ record %s could not be withdrawn (%r)", record_id, exc)


async def _handoff(
    svc: RunnerServices, delivery: Delivery, execution: Execution, events: EventLog
) -> Plan:
    """The drain's handoff (SPEC §5.6): one CAS releases the lease and bumps the attempt, so the
    next execution is a new attempt that spends no delivery budget; then publish it, record it,
    and `ack_sync` the old delivery. A crash in between is repaired by the sweeper."""
    writer = execution.writer
    run_id = execution.run_id
    if writer.on_release is not None:
        # The CAS drops the lease: the keeper's next beat must not take that for a takeover
        # (found in the chaos soak's log). Should the CAS not land, the lease simply lapses,
        # which is this path's recovery anyway (the redelivery's auto-retry claim).
        writer.on_release()
    try:
        result = await _handoff_cas(svc, execution)
    except Exception as exc:  # noqa: BLE001 - a handoff that cannot write naks
        # RUNNER_INTERRUPTED is written and auto-resumable: once the lease expires, the
        # redelivery's auto-retry claim takes the run (it spends one delivery, no more).
        log.warning("run %s: handoff CAS failed (%r); nak", run_id, exc)
        if writer.cancel.lease_spent():
            # The keeper stopped at `on_release`, so nobody judged the lease while the CAS
            # failed: past its loss margin an adopter may hold the run and this delivery's
            # sequence. Fenced, as `dispose_outcome`'s refused release is (SPEC §5.4; found by
            # review, replayed by the protocol model).
            return Plan("none", reason="lease_lost")
        delay = await _nak_quietly(delivery, svc, "store_unreachable")
        return Plan("nak", delay, reason="store_unreachable")
    if isinstance(result, CasConflict):
        current = result.current
        if current is None or current.lease is None or current.lease.token != writer.token:
            # Not an operator: the lease itself is gone, and the delivery is the adopter's.
            execution.cancel.cancel(CancelReason.LEASE_LOST)
            return Plan("none", reason="lease_lost")
        # An operator acted in between: a plain release, then the ack. A release that finds
        # the lease gone means it was taken over meanwhile: no disposition (SPEC §5.4).
        if await writer.release() is None:
            execution.cancel.cancel(CancelReason.LEASE_LOST)
            return Plan("none", reason="lease_lost")
        await delivery.ack_sync()
        return Plan("ack", reason="handoff_superseded")
    await publish_handoff(svc, result)
    await delivery.ack_sync()
    return Plan("handoff", reason="drain")


async def _handoff_cas(svc: RunnerServices, execution: Execution) -> RunDocument | CasConflict:
    writer = execution.writer
    attempt = execution.run_doc.attempt
    return await svc.store.update_run(
        execution.run_id,
        [
            Eq("lease.token", writer.token),
            Eq("attempt", attempt),
            Eq("status", RunStatus.FAILED_RESUMABLE),
            Eq("failure_code", FailureCode.RUNNER_INTERRUPTED),
        ],
        Update(set={"attempt": attempt + 1, "attempt_at": utcnow()}, unset=["lease"]),
    )


async def _nak_quietly(delivery: Delivery, svc: RunnerServices, reason: str) -> float:
    delay = transient_delay(
        FailureCode.INTERNAL_ERROR,
        delivery.info.num_delivered,
        svc.settings.transient_delay,
        svc.settings.transient_delay_cap,
    )
    try:
        await delivery.nak(delay)
    except Exception as exc:  # noqa: BLE001 - redelivered after ack_wait anyway
        log.warning("nak (%s) not sent (%r)", reason, exc)
    return delay
