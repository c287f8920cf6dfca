"""The DLQ backstop (SPEC §5.6): a durable consumer of the MAX_DELIVERIES advisories.

A message that reached `max_deliver` without a disposition stays in the work stream (NOTES.md).
The backstop settles each one as an admission at `num_delivered = max_deliver`, writing nothing
before it has judged, and acks the advisory only once the message is settled. Because the
advisories are captured in a stream, none is lost while no runner is connected.
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

from engine.failures import FailureCode, is_auto_resumable
from publisher.errors import MalformedMessage, UnsupportedSchema
from publisher.wire import RunMessage, decode
from runner.admission import SETTLED
from runner.services import RunnerServices
from store import (
    CasConflict,
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

log = logging.getLogger(__name__)


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
        while True:
            try:
                msgs = await psub.fetch(batch=10, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except nats.errors.Error as exc:
                # NATS restarting (a 503 on the pull, a closed connection reconnecting): the
                # advisories wait in their stream; try again shortly, like the fetch loop.
                log.warning("backstop: fetch failed (%r); retrying", exc)
                await asyncio.sleep(1.0)
                continue
            for msg in msgs:
                await self.settle_advisory(msg)

    async def settle_advisory(self, adv: Msg) -> str:
        try:
            seq = int(json.loads(adv.data)["stream_seq"])
        except (ValueError, KeyError, TypeError):
            log.error("backstop: unreadable advisory %r; acked", adv.data[:200])
            await adv.ack()
            return "bad_advisory"
        try:
            verdict, delay = await self.settle(seq)
        except StoreError as exc:
            log.warning("backstop: store unavailable for seq %s (%s)", seq, exc)
            verdict, delay = "store_error", 5.0
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("backstop: NATS error settling seq %s (%r)", seq, exc)
            verdict, delay = "nats_error", 5.0
        try:
            if delay is None:
                await adv.ack_sync()
            else:
                await adv.nak(delay=delay)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("backstop: advisory for seq %s not disposed (%r)", seq, exc)
        return verdict

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
        except (MalformedMessage, UnsupportedSchema) as exc:
            await self._record(seq, body, headers, None, "malformed", exc.message, False)
            await self._delete(seq)
            return "malformed", None
        try:
            run = await svc.store.get_run(message.run_id)
        except RunNotFound:
            await self._record(seq, body, headers, message, "run_not_found", "no such run", False)
            await self._delete(seq)
            return "run_not_found", None
        if message.attempt < run.attempt or (message.attempt == run.attempt and self._settled(run)):
            if (
                message.attempt == run.attempt
                and run.failure_code == FailureCode.DLQ_PARKED
                and not await self._has_record(seq)
            ):
                # Its runner died between the record and the park's ack: restore the record.
                await self._record(seq, body, headers, message, "max_deliveries", "", True)
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
        await self._record(
            seq,
            body,
            headers,
            message,
            "max_deliveries",
            f"status {run.status} {run.failure_code or ''}".strip(),
            True,
        )
        parked = await svc.store.update_run(
            run.run_id,
            [Eq("status", run.status), Eq("attempt", run.attempt), LeaseFree(now, svc.skew)],
            Update(
                set={
                    "status": RunStatus.FAILED_RESUMABLE,
                    "failure_code": FailureCode.DLQ_PARKED,
                    "cause_code": run.failure_code,
                    "error": "the message reached max_deliver without a disposition",
                },
                unset=["lease"],
            ),
        )
        if isinstance(parked, CasConflict):
            return "raced", 1.0  # judge again on the advisory's redelivery
        await svc.store.append_event(
            run.run_id,
            "run_dlq_parked",
            {"reason": "max_deliveries", "record_id": seq},
            attempt=run.attempt,
        )
        await self._delete(seq)
        return "parked", None

    @staticmethod
    def _settled(run: RunDocument) -> bool:
        return run.status in SETTLED or (
            run.status is RunStatus.FAILED_RESUMABLE and not is_auto_resumable(run.failure_code)
        )

    async def _has_record(self, seq: int) -> bool:
        from publisher.errors import RecordNotFound

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
