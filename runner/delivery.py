"""One delivery, start to end (SPEC §5.1-§5.6), read top to bottom in the order it happens:
decode → load → admission → claim → lease → engine → disposition.

`handle()` is the supervised task: it catches everything. Without a lease an unexpected error
naks with the transient delay (and at the last delivery records the message `internal_error`);
with a lease it becomes the outcome `failed_resumable INTERNAL_ERROR`, disposed of like any
transient code. A poison message never kills a runner.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

from engine.cancel import CancelSignal
from engine.events import EventLog
from engine.execution import Execution
from engine.failures import FailureCode
from engine.fencing import LeaseLost
from engine.outcome import CancelReason, Failed, Interrupted, Outcome
from publisher.errors import MalformedMessage, UnsupportedSchema
from publisher.nats_errors import JETSTREAM_UNANSWERED
from publisher.wire import RunMessage, decode
from runner.admission import Ack, CancelStale, Claim, ClaimPath, Dead, Nak, Refuse, judge
from runner.claim import cancel_stale, claim, park_refusal, refuse_answer
from runner.delays import transient_delay
from runner.deliveries import Delivery
from runner.disposition import dispose_outcome
from runner.handon import hand_on
from runner.lease import HeldLease
from runner.metrics import status_label
from runner.repair import repair_status_event
from runner.services import RunnerServices
from store import (
    CasConflict,
    DocumentInvalid,
    RunDocument,
    RunNotFound,
    StoreError,
    StoreUnavailable,
    utcnow,
)
from store.staging import StagedUploadInvalid, StagedUploadNotFound

log = logging.getLogger(__name__)


async def handle(svc: RunnerServices, delivery: Delivery) -> None:
    try:
        await _handle(svc, delivery)
    except JETSTREAM_UNANSWERED as exc:  # an election or a reconnect (C5), not a bug
        log.warning(
            "delivery seq=%s: JetStream did not answer (%r); disposed again",
            delivery.info.stream_seq,
            exc,
        )
        if delivery.disposed is None:
            await _last_resort(svc, delivery, exc, nak_reason="nats_unanswered")
    except Exception as exc:
        log.exception("delivery seq=%s: unexpected error", delivery.info.stream_seq)
        if delivery.disposed is None:
            await _last_resort(svc, delivery, exc)


async def _last_resort(
    svc: RunnerServices, delivery: Delivery, exc: Exception, *, nak_reason: str = "internal_error"
) -> None:
    try:
        if delivery.info.is_last and not delivery.leased:
            await dead_letter(svc, delivery, delivery.message, "internal_error", repr(exc))
        else:
            await _nak_transient(svc, delivery, nak_reason)
    except Exception:
        log.exception("delivery seq=%s: could not dispose after an error", delivery.info.stream_seq)


async def _nak_transient(svc: RunnerServices, delivery: Delivery, reason: str) -> None:
    delay = transient_delay(
        FailureCode.INTERNAL_ERROR,
        delivery.info.num_delivered,
        svc.settings.transient_delay,
        svc.settings.transient_delay_cap,
    )
    await delivery.nak(delay)
    await svc.delivery_log.disposed(delivery, "nak", reason, delay=delay)


async def dead_letter(
    svc: RunnerServices,
    delivery: Delivery,
    message: RunMessage | None,
    reason: str,
    detail: str,
    *,
    replayable: bool = True,
) -> None:
    """Record, then ack (confirmed): nothing is dropped, not even bytes we cannot decode."""
    record = await svc.dlq.put(
        seq=delivery.info.stream_seq,
        body=delivery.data,
        headers=delivery.headers,
        reason=reason,
        detail=detail,
        run_id=message.run_id if message else None,
        attempt=message.attempt if message else None,
        num_delivered=delivery.info.num_delivered,
        runner=svc.owner,
        replayable=replayable,
    )
    svc.metrics.dlq_records.labels(reason=reason).inc()
    await delivery.ack_sync()
    await svc.delivery_log.disposed(delivery, "dlq", reason, record_id=record.id)
    # An operator reads the runner's log first: what went to the DLQ, and why (the detail as
    # a repr: it may hold whatever bytes the message carried).
    log.warning(
        "DLQ record %s (%s) for run %s, delivery %s: %.200r",
        record.id,
        reason,
        message.run_id if message else "-",
        delivery.info.num_delivered,
        detail,
    )


async def _handle(svc: RunnerServices, delivery: Delivery) -> None:
    if svc.draining and not delivery.info.is_last:
        # Fetched after SIGTERM: another runner takes it a second later (SPEC §5.1). The last
        # delivery is judged instead: a nak there would send it to the backstop (§5.8).
        delay = svc.settings.drain_nak_delay.total_seconds()
        await delivery.nak(delay)
        await svc.delivery_log.disposed(delivery, "nak", "draining", delay=delay)
        return
    # Step 1: decode and validate.
    try:
        message = delivery.message = decode(delivery.data, delivery.headers)
    except MalformedMessage as exc:
        await dead_letter(svc, delivery, None, "malformed", exc.message, replayable=False)
        return
    except UnsupportedSchema as exc:
        if delivery.info.is_last:
            await dead_letter(svc, delivery, None, "unsupported_schema", exc.message)
        else:
            delay = svc.settings.unsupported_schema_delay.total_seconds()
            await delivery.nak(delay)
            await svc.delivery_log.disposed(delivery, "nak", "unsupported_schema", delay=delay)
        return
    for _ in range(svc.settings.claim_retries + 1):
        try:
            claimed = await _admit(svc, delivery, message)
        except DocumentInvalid as exc:
            # The store answered, with a run that does not validate: no outage to wait out,
            # and naking it forever (as a store error) hid it from everyone (an on-call
            # walkthrough). Said loudly, retried on the transient ladder in case someone mends
            # it, and recorded at the last delivery, replayable once the document is fixed.
            log.error("run %s: its stored document does not validate: %s", message.run_id, exc)
            if delivery.info.is_last:
                detail = f"the stored run does not validate: {exc.message}"
                await dead_letter(svc, delivery, message, "internal_error", detail)
            else:
                await _nak_transient(svc, delivery, "run_invalid")
            return
        except StoreError as exc:
            # A store outage is never an outcome and never a DLQ record (SPEC v2.2 §5.1).
            log.warning("run %s: store unreachable at admission (%s)", message.run_id, exc)
            await _nak_transient(svc, delivery, "store_unreachable")
            return
        if claimed == "again":
            continue  # a lost CAS: re-enter at step 2 (bounded)
        if claimed is not None:
            await _execute(svc, delivery, message, claimed.run, claimed.path)
        return
    await _nak_transient(svc, delivery, "claim_lost")


@dataclass(frozen=True, slots=True)
class _Claimed:
    run: RunDocument
    path: ClaimPath


async def _admit(
    svc: RunnerServices, delivery: Delivery, message: RunMessage
) -> _Claimed | Literal["again"] | None:
    """Steps 2-8 once. Returns the claimed run, "again" after a CAS lost to a concurrent
    writer, or None when the delivery was disposed of here. Store errors propagate: the
    caller naks with the transient delay (a store outage never writes a DLQ record)."""
    # Step 2: load the run (unfiltered by tenant).
    try:
        run = await svc.store.get_run(message.run_id)
    except RunNotFound:
        age = utcnow() - message.published_at
        if age < svc.settings.young_message and not delivery.info.is_last:
            delay = svc.settings.lagging_delay.total_seconds()
            await delivery.nak(delay)
            await svc.delivery_log.disposed(delivery, "nak", "run_not_found_yet", delay=delay)
        else:
            detail = f"no run {message.run_id}"
            await dead_letter(svc, delivery, message, "run_not_found", detail, replayable=False)
        return None
    if message.tenant != run.tenant:
        detail = f"message tenant {message.tenant!r} is not the run's"
        await dead_letter(svc, delivery, message, "tenant_mismatch", detail, replayable=False)
        return None
    # Steps 3-8.
    now = utcnow()
    decision = judge(message, run, delivery.info, now, svc.timing)
    if isinstance(decision, Ack):
        if decision.reason == "settled" and await repair_status_event(
            svc.store, run, now, svc.skew
        ):
            log.warning("run %s: repaired its missing %s event", run.run_id, run.status)
        await delivery.ack()
        await svc.delivery_log.disposed(delivery, "ack", decision.reason)
        log.info("run %s attempt %s: %s", run.run_id, message.attempt, decision.reason)
        return None
    if isinstance(decision, Nak):
        await delivery.nak(decision.delay)
        await svc.delivery_log.disposed(delivery, "nak", decision.reason, delay=decision.delay)
        return None
    if isinstance(decision, Dead):
        if decision.reason == "no_claim_path":
            log.error("run %s: no claim path (%s): a bug", run.run_id, decision.detail)
        await dead_letter(svc, delivery, message, decision.reason, decision.detail)
        return None
    if isinstance(decision, CancelStale):
        result = await cancel_stale(svc.store, run, now=now, skew=svc.skew)
        if isinstance(result, CasConflict):
            return "again"
        await svc.store.append_event(run.run_id, "run_cancelled", {}, attempt=run.attempt)
        await delivery.ack()
        await svc.delivery_log.disposed(delivery, "ack", "cancelled")
        return None
    if isinstance(decision, Refuse):
        parked = await park_refusal(
            svc.store, run, decision.kind, decision.path, decision.detail, now=now, skew=svc.skew
        )
        if isinstance(parked, CasConflict):
            return "again"
        await _refusal_event(svc, parked, decision.kind)
        await delivery.ack()
        await svc.delivery_log.disposed(delivery, "ack", f"refused_{decision.kind}")
        return None
    assert isinstance(decision, Claim)
    if svc.draining and decision.path == "fresh":
        # A draining runner holding the last delivery of a queued run (SPEC v2.2 §5.8).
        return None if await hand_on(svc, delivery, run, now) else "again"
    try:
        claimed = await claim(
            svc.store,
            run,
            decision.path,
            delivery.info,
            owner=svc.owner,
            now=now,
            ttl=svc.ttl,
            skew=svc.skew,
            blobs=svc.blobs,
        )
    except (StagedUploadNotFound, StagedUploadInvalid) as exc:
        # A file answer whose upload is gone: the resume is refused, the run waits again.
        refused = await refuse_answer(svc.store, run, exc.message, now=now, skew=svc.skew)
        if isinstance(refused, CasConflict):
            return "again"
        await _refusal_event(svc, refused, "answer")
        await delivery.ack()
        await svc.delivery_log.disposed(delivery, "ack", "refused_answer")
        return None
    if isinstance(claimed, CasConflict):
        svc.metrics.child(svc.metrics.claims, decision.path, "lost").inc()
        return "again"
    svc.metrics.child(svc.metrics.claims, decision.path, "won").inc()
    if run.failure_code == FailureCode.RUNNER_INTERRUPTED:  # a drained runner's handoff
        svc.metrics.handoffs_taken.inc()
    await svc.delivery_log.disposed(delivery, "claim", decision.path, counted=False)
    svc.metrics.queue_wait.observe(max((now - message.published_at).total_seconds(), 0.0))
    return _Claimed(claimed, decision.path)


async def _refusal_event(svc: RunnerServices, doc: RunDocument, kind: str) -> None:
    if kind == "budget":
        await svc.store.append_event(
            doc.run_id,
            "run_paused",
            {"kind": "budget", "code": doc.failure_code},
            attempt=doc.attempt,
        )
    else:
        await svc.store.append_event(
            doc.run_id,
            "run_failed",
            {"code": doc.failure_code, "error": doc.error},
            attempt=doc.attempt,
        )


async def _execute(
    svc: RunnerServices, delivery: Delivery, message: RunMessage, run: RunDocument, path: str
) -> None:
    """Everything from the claim's winning CAS to the disposition is under the held lease
    (SPEC v2.2 §5.1): whatever raises once `delivery.leased` is set — `stop_others`, the
    claim's events, loading the stored source, the engine — is the outcome `failed_resumable
    INTERNAL_ERROR`, disposed of like any transient code, with teardown and release still
    attempted (`dispose_outcome`). What comes before it only builds objects, and cannot fail."""
    assert run.lease is not None
    cancel = CancelSignal()
    events = EventLog(
        svc.store,
        run.run_id,
        run.attempt,
        run.lease.token,
        cancel,
        listener=svc.metrics.on_event,
        defer=True,  # narration rides with the state writes (issue 19, ADR-0014)
        rider=svc.metrics.on_event,
    )
    execution = Execution.claimed(svc.engine_env, run, cancel, events)
    started = time.monotonic()
    delivery.leased = True  # from here on an error is an outcome, never a DLQ record
    svc.metrics.inflight.inc()
    try:
        async with HeldLease(svc, run, delivery, cancel) as held:
            events.deadline = held.keeper.seconds_left
            execution.writer.on_release = held.keeper.stop
            outcome = await _run(svc, execution, path)
            plan = await dispose_outcome(svc, delivery, message, execution, events, outcome)
            await svc.delivery_log.disposed(
                delivery,
                plan.action,
                plan.reason,
                delay=plan.delay if plan.action == "nak" else None,
                record_id=plan.record_id,
            )
            svc.metrics.child(svc.metrics.run_duration, status_label(plan.reason)).observe(
                time.monotonic() - started
            )
    finally:
        svc.metrics.inflight.dec()


async def _run(svc: RunnerServices, execution: Execution, path: str) -> Outcome:
    if execution.cancel.reason is CancelReason.LEASE_LOST:
        # The lease was lost before it was held (the claim landed past its loss margin):
        # not even `begin()`, whose `stop_others` would stop an adopter's sandbox.
        return Interrupted(CancelReason.LEASE_LOST)
    try:
        await execution.begin(path, svc.owner)
        if svc.draining:
            # The claim's CAS won after the drain began (its cancel signal was registered
            # after the broadcast): hand it off now, never run it to the ceiling (§5.8).
            return Interrupted(CancelReason.DRAIN)
        return await execution.run()
    except LeaseLost:
        return Interrupted(CancelReason.LEASE_LOST)
    except StoreUnavailable as exc:
        # An outage, not a bug (a network drill: one runner paused holding SQLite's write
        # lock): no traceback, and the run is retried like any transient failure.
        log.warning("run %s: the store did not answer: %s", execution.run_id, exc)
        return Failed(FailureCode.INTERNAL_ERROR, f"store unavailable: {str(exc)[:500]}")
    except Exception as exc:
        log.exception("run %s: execution failed unexpectedly", execution.run_id)
        return Failed(FailureCode.INTERNAL_ERROR, f"{type(exc).__name__}: {str(exc)[:500]}")
