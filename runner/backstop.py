"""The DLQ backstop (SPEC §5.6): a durable consumer of the MAX_DELIVERIES advisories.

A message that reached `max_deliver` without a disposition stays in the work stream (NOTES.md).
The backstop settles each one as an admission at `num_delivered = max_deliver`, writing nothing
before it has judged, and acks the advisory only once the message is settled. Because the
advisories are captured in a stream, none is lost while no runner is connected.

No content of a single message may stop the loop (§5.1, §13.12): an advisory or a body that
cannot be read is judged, never raised, and anything else one message makes `settle` raise is
handled as an admission's internal error at the last delivery (§5.1): recorded, then deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from engine.failures import FailureCode
from publisher.errors import MalformedMessage, RecordNotFound, UnsupportedSchema
from publisher.wire import RunMessage, decode
from runner.admission import is_settled
from runner.services import RunnerServices
from store import (
    CasConflict,
    DocumentInvalid,
    Eq,
    LeaseFree,
    RunDocument,
    RunNotFound,
    RunStatus,
    StoreError,
    Update,
    lease_is_free,
    utcnow,
)
from store.events import events_newest_first

log = logging.getLogger(__name__)

SPENT = "the message reached max_deliver without a disposition"
"""The error of a run the backstop parks (and the start of it, when the log says more)."""
EXPLAIN_WITHIN_S = 2.0
"""How long a park may spend reading the run's delivery log for its explanation."""

TRANSIENT_NAK = 5.0
"""Seconds before an advisory nak'd for a store or NATS error is judged again."""
UNRECORDABLE_NAK = 30.0
"""Seconds before an advisory is judged again when an unexpected error left its message not
even recordable: the message stays in the stream, so nothing is deleted without a record."""
MAX_SEQ = 2**64 - 1  # a JetStream sequence is a uint64


def advisory_seq(data: bytes) -> int | None:
    """The work-stream sequence a MAX_DELIVERIES advisory names, or None when it names none
    we can act on. Never raises: a deeply nested body raises `RecursionError` in the parser,
    a 5 000-digit number `ValueError`, and a float, a bool, a string or a number outside
    uint64 is not a sequence (a forged one must not settle someone else's message)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError, TypeError):
        return None
    seq = doc.get("stream_seq") if isinstance(doc, dict) else None
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
        return None
    return seq


def _decoded(body: bytes, headers: dict[str, str]) -> RunMessage | None:
    """Best effort, for recording what an internal error left: the message, or None."""
    try:
        return decode(body, headers)
    except Exception:  # noqa: BLE001 - anything a hostile body raises means "not decodable"
        return None


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text[:300]}{'…' if len(text) > 300 else ''}"


class Backstop:
    def __init__(self, svc: RunnerServices) -> None:
        self.svc = svc
        self.psub: JetStreamContext.PullSubscription | None = None

    async def subscribe(self) -> JetStreamContext.PullSubscription:
        self.psub = await self.svc.js.pull_subscribe_bind(
            self.svc.names.backstop_consumer, stream=self.svc.names.advisory_stream
        )
        return self.psub

    async def loop(self) -> None:
        psub = self.psub or await self.subscribe()
        polled = self.svc.metrics.backstop_last_poll
        while True:
            try:
                msgs = await psub.fetch(batch=10, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                polled.set_to_current_time()  # asked, and nothing waits
                continue
            except nats.errors.Error as exc:
                # NATS restarting (a 503 on the pull, a closed connection reconnecting): the
                # advisories wait in their stream; try again shortly, like the fetch loop.
                log.warning("backstop: fetch failed (%r); retrying", exc)
                await asyncio.sleep(1.0)
                continue
            for msg in msgs:
                await self.settle_advisory(msg)  # never raises but CancelledError
            # After settling, not before: a settle that never returns stops the stamp, which is
            # what an alert on it is for.
            polled.set_to_current_time()

    async def settle_advisory(self, adv: Msg) -> str:
        """Settle one advisory; returns the verdict. Catches everything one message can raise
        (SPEC §5.1 last sentence): only cancellation leaves this method by an exception."""
        seq = advisory_seq(adv.data)
        if seq is None:
            log.error("backstop: unreadable advisory %r; acked", adv.data[:200])
            await self._dispose(adv, None, None)
            return "bad_advisory"
        try:
            verdict, delay = await self.settle(seq)
        except DocumentInvalid as exc:  # an answer, not an outage: recorded, never naked forever
            log.error("backstop: seq %s names a run whose document does not validate: %s", seq, exc)
            verdict, delay = await self._internal_error(seq, exc)
        except StoreError as exc:
            log.warning("backstop: store unavailable for seq %s (%s)", seq, exc)
            verdict, delay = "store_error", TRANSIENT_NAK
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("backstop: NATS error settling seq %s (%r)", seq, exc)
            verdict, delay = "nats_error", TRANSIENT_NAK
        except Exception as exc:
            log.exception("backstop: settling seq %s raised; recording it internal_error", seq)
            verdict, delay = await self._internal_error(seq, exc)
        await self._dispose(adv, seq, delay)
        return verdict

    async def _dispose(self, adv: Msg, seq: int | None, delay: float | None) -> None:
        """Ack a settled advisory (confirmed), nak an unsettled one with its delay. A failure
        here is logged: the advisory is then redelivered after its ack_wait and judged again."""
        try:
            if delay is None:
                await adv.ack_sync()
            else:
                await adv.nak(delay=delay)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("backstop: advisory for seq %s not disposed (%r)", seq, exc)
        except Exception:
            log.exception("backstop: advisory for seq %s not disposed", seq)

    async def _internal_error(self, seq: int, exc: Exception) -> tuple[str, float | None]:
        """An unexpected error while settling is an admission's internal error at the last
        delivery (SPEC §5.1): record the message `internal_error` (unless a record for that
        sequence exists already: a runner's or our own park's record says more), delete it,
        ack the advisory. The run is left as it was; the sweeper parks a run whose message was
        dead-lettered instead of republishing it (§5.9). When even that cannot be done, the
        message stays, and the advisory is nak'd to be judged again later."""
        svc = self.svc
        try:
            try:
                raw = await svc.js.get_msg(svc.names.runs_stream, seq)
            except NotFoundError:
                return "gone", None
            body = raw.data or b""
            headers = dict(raw.headers or {})
            if not await self._has_record(seq):
                message = _decoded(body, headers)
                await self._record(
                    seq, body, headers, message, "internal_error", _describe(exc), True
                )
            await self._delete(seq)
        except Exception:
            log.exception("backstop: seq %s could not be recorded; the advisory waits", seq)
            return "internal_error", UNRECORDABLE_NAK
        return "internal_error", None

    async def settle(self, seq: int) -> tuple[str, float | None]:
        """Judge one max-delivered message. Returns (verdict, nak delay for the advisory or
        None when it is settled)."""
        svc = self.svc
        try:
            raw = await svc.js.get_msg(svc.names.runs_stream, seq)
        except NotFoundError:
            return "gone", None
        body = raw.data or b""
        headers = dict(raw.headers or {})
        try:
            message = decode(body, headers)
        except UnsupportedSchema as exc:  # §5.2 step 1, at the last delivery
            await self._record(seq, body, headers, None, exc.code, exc.message, False)
            await self._delete(seq)
            return exc.code, None
        except MalformedMessage as exc:
            await self._record(seq, body, headers, None, "malformed", exc.message, False)
            await self._delete(seq)
            return "malformed", None
        except Exception as exc:  # noqa: BLE001 - v2.2 §5.2 step 1: whatever the parser raises
            await self._record(seq, body, headers, None, "malformed", _describe(exc), False)
            await self._delete(seq)
            return "malformed", None
        try:
            run = await svc.store.get_run(message.run_id)
        except RunNotFound:
            await self._record(seq, body, headers, message, "run_not_found", "no such run", False)
            await self._delete(seq)
            return "run_not_found", None
        if message.tenant != run.tenant:  # §5.2 step 2, as admission checks it
            detail = f"message tenant {message.tenant!r} is not the run's"
            await self._record(seq, body, headers, message, "tenant_mismatch", detail, False)
            await self._delete(seq)
            return "tenant_mismatch", None
        if message.attempt < run.attempt or (message.attempt == run.attempt and is_settled(run)):
            if (
                message.attempt == run.attempt
                and run.failure_code == FailureCode.DLQ_PARKED
                and not await self._has_record(seq)
            ):
                # A park whose record is missing (a park written before SPEC §5.6's order was
                # kept, or a record deleted by hand): restore it, and the event after it.
                await self._record(seq, body, headers, message, "max_deliveries", "", True)
                await self._park_event(run, seq, only_if_missing=True)
            elif message.attempt == run.attempt and run.failure_code != FailureCode.DLQ_PARKED:
                await self._withdraw_unparked(run, seq)
            await self._delete(seq)
            return "settled", None
        if message.attempt > run.attempt:
            # A lagging read resolves within seconds; a copy still ahead of its run after
            # max_deliver deliveries is forged or corrupt. Kept as a record, not nak'd forever.
            await self._record(
                seq,
                body,
                headers,
                message,
                "attempt_ahead",
                f"message attempt {message.attempt} > run attempt {run.attempt}",
                False,
            )
            await self._delete(seq)
            return "attempt_ahead", None
        now = utcnow()
        if not lease_is_free(run, now, svc.skew):
            assert run.lease is not None
            wait = (run.lease.expires_at + svc.skew - now).total_seconds()
            return "lease_held", max(wait, 0.5)
        return await self._park(seq, body, headers, message, run)

    async def _park(
        self,
        seq: int,
        body: bytes,
        headers: dict[str, str],
        message: RunMessage,
        run: RunDocument,
    ) -> tuple[str, float | None]:
        """SPEC §5.6, in its order: record, then park by CAS on the status and attempt read ∧
        lease free, then the event, then delete the message. A CAS that loses (a runner claimed
        the run, an operator acted) takes the record back: no replayable record outlives a park
        that did not happen (issue 12 item 6), and the advisory is judged again. A crash between
        the record and the park leaves the message and the advisory: the redelivered advisory
        records again (same id) and parks; if the run has moved on by then, the settled branch
        of `settle` withdraws the record the park never followed (`_withdraw_unparked`)."""
        detail = f"status {run.status} {run.failure_code or ''}".strip()
        error = SPENT + await self._spent_while_owned(run, seq)  # before the record, bounded
        await self._record(seq, body, headers, message, "max_deliveries", detail, True)
        try:
            parked = await self._park_cas(run, error)
        except Exception:
            await self._withdraw(seq)  # the catch-all then records what stopped the park
            raise
        if isinstance(parked, CasConflict):
            await self._withdraw(seq)
            return "raced", 1.0  # judge again on the advisory's redelivery
        await self._park_event(run, seq)
        await self._delete(seq)
        return "parked", None

    async def _spent_while_owned(self, run: RunDocument, seq: int) -> str:
        """What the park's error adds when the delivery log shows the message's deliveries
        were spent while the run's owner lived (a network drill: a runner cut off from NATS but
        not from the store kept its lease, the others nak'd every redelivery, §5.2, and the
        park read as if nothing had held the run). Empty when the log says otherwise or cannot
        be read within `EXPLAIN_WITHIN_S`: the park waits on it no longer than that."""
        from runner.delivery_log import read_deliveries  # the park path only

        try:
            logged = [
                e
                for _, e in await asyncio.wait_for(
                    read_deliveries(self.svc.js, self.svc.names, run.run_id), EXPLAIN_WITHIN_S
                )
            ]
        except Exception as exc:  # noqa: BLE001 - an explanation, never a reason not to park
            log.debug("backstop: run %s's delivery log unread (%r)", run.run_id, exc)
            return ""
        mine = [e for e in logged if e.stream_seq == seq]
        naks = [e for e in mine if e.reason == "redelivery_while_owner_lives"]
        if not naks:
            return ""
        owners = sorted({e.runner for e in mine if e.action == "claim"})
        owner = " or ".join(owners) if owners else "its owner"
        return (
            f"; {len(naks)} of its deliveries came while {owner} held the run and were nak'd"
            " (§5.2): that runner could not settle its own delivery — was it cut off from NATS?"
        )

    async def _park_cas(self, run: RunDocument, error: str) -> RunDocument | CasConflict:
        svc = self.svc
        return await svc.store.update_run(
            run.run_id,
            [Eq("status", run.status), Eq("attempt", run.attempt), LeaseFree(utcnow(), svc.skew)],
            Update(
                set={
                    "status": RunStatus.FAILED_RESUMABLE,
                    "failure_code": FailureCode.DLQ_PARKED,
                    "cause_code": run.failure_code,
                    "error": error,
                },
                unset=["lease"],
            ),
        )

    async def _withdraw(self, seq: int) -> None:
        """Take back the record of a park that did not happen. If it cannot be taken back now,
        the advisory's redelivery judges again (and `_withdraw_unparked` finds it)."""
        try:
            await self.svc.dlq.delete(seq)
        except Exception as exc:  # noqa: BLE001 - judged again on the advisory's redelivery
            log.warning("backstop: record %s could not be withdrawn (%r)", seq, exc)

    async def _withdraw_unparked(self, run: RunDocument, seq: int) -> None:
        """The settled branch, for a run that is not `DLQ_PARKED` at the message's attempt: a
        `max_deliveries` record of that attempt with no `run_dlq_parked` event after it is one
        the backstop wrote before a park it never made (it died between the two); withdrawn, so
        no replay acts on a run that was not parked."""
        try:
            rec = await self.svc.dlq.get(seq)
        except RecordNotFound:
            return
        if rec.reason != "max_deliveries" or rec.attempt != run.attempt:
            return
        if not await self._parked_event_exists(run):
            await self._withdraw(seq)

    async def _park_event(
        self, run: RunDocument, seq: int, *, only_if_missing: bool = False
    ) -> None:
        store = self.svc.store
        if only_if_missing and await self._parked_event_exists(run):
            return
        await store.append_event(
            run.run_id,
            "run_dlq_parked",
            {"reason": "max_deliveries", "record_id": seq},
            attempt=run.attempt,
        )

    async def _parked_event_exists(self, run: RunDocument) -> bool:
        """Whether the run has a `run_dlq_parked` event at its current attempt."""
        async for e in events_newest_first(self.svc.store, run.run_id):
            if e.type == "run_dlq_parked" and e.attempt == run.attempt:
                return True
        return False

    async def _has_record(self, seq: int) -> bool:
        try:
            await self.svc.dlq.get(seq)
        except RecordNotFound:
            return False
        return True

    async def _record(
        self,
        seq: int,
        body: bytes,
        headers: dict[str, str],
        message: RunMessage | None,
        reason: str,
        detail: str,
        replayable: bool,
    ) -> None:
        await self.svc.dlq.put(
            seq=seq,
            body=body,
            headers=headers,
            reason=reason,
            detail=detail,
            run_id=message.run_id if message else None,
            attempt=message.attempt if message else None,
            num_delivered=self.svc.wire.max_deliver,
            runner=f"backstop:{self.svc.owner}",
            replayable=replayable,
        )
        self.svc.metrics.dlq_records.labels(reason=reason).inc()
        log.warning(
            "backstop: DLQ record %s (%s) for run %s: %.200r",
            seq,
            reason,
            message.run_id if message else "-",
            detail,
        )
        await self.svc.delivery_log.record(
            message.run_id if message else None,
            seq,
            self.svc.wire.max_deliver,
            "dlq",
            reason,
            record_id=seq,
            attempt=message.attempt if message else None,
            runner=f"backstop:{self.svc.owner}",
        )

    async def _delete(self, seq: int) -> None:
        """Delete by sequence; a message someone else removed meanwhile (a runner's last ack,
        another backstop) is already where we wanted it."""
        try:
            await self.svc.js.delete_msg(self.svc.names.runs_stream, seq)
        except APIError:
            with contextlib.suppress(NotFoundError):
                await self.svc.js.get_msg(self.svc.names.runs_stream, seq)
                raise  # still there: a real failure
            log.info("backstop: seq %s was already gone", seq)
