"""The publisher (SPEC §4): the only thing that queues a run.

Every publication carries the run's attempt; the attempt is bumped by the CAS that queues a
resume, *before* the publish, so a runner can always tell a live delivery from a superseded one.
The order of each operation is the order of SPEC §4, and each failure leaves the run where a
person (or the sweeper) can pick it up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import APIError, NoStreamResponseError
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from engine.failures import FailureCode
from engine.loader import LoadedWorkflow
from engine.resume import ResumeRequest, judge_resume
from engine.vars import resolve_vars
from publisher.cancel import cancel_run
from publisher.config import WireSettings
from publisher.dlq import DlqStore
from publisher.errors import (
    DuplicatePublication,
    JetStreamUnavailable,
    PublishFailed,
    ResumeTooLarge,
)
from publisher.launch_records import LaunchRecords
from publisher.nats_errors import (
    PUBLISH_RETRYABLE,
    is_stream_missing,
    msg_id_in_process,
    publish_retryable,
    translate_nats_error,
)
from publisher.replay import replay_record
from publisher.wire import MessageKind, ResumeCopy, RunMessage, WireNames, encode, msg_id
from store import (
    CasConflict,
    Eq,
    EventDraft,
    Ne,
    Origin,
    Publication,
    RunDocument,
    RunNotFound,
    RunStatus,
    RunStore,
    StagedFile,
    Update,
    WorkflowRef,
    utcnow,
)

log = logging.getLogger(__name__)

_FIRST_WAIT_S = 0.1
"""The wait before a publish's second try; each later one doubles it, up to 2 s."""
_PROBE_S = 1.0
"""How long a failed publish waits for the stream's info before it is tried again."""


class Publisher:
    def __init__(
        self,
        *,
        store: RunStore,
        nc: Client,
        js: JetStreamContext,
        settings: WireSettings,
        names: WireNames | None = None,
        dlq: DlqStore | None = None,
    ) -> None:
        self.store = store
        self.nc = nc
        self.js = js
        self.settings = settings
        self.names = names or WireNames(settings.namespace)
        self.dlq = dlq
        self.launch_records = LaunchRecords(
            store, lambda run, ack, at: self.record_publication(run, ack, at=at)
        )

    # -- publishing --------------------------------------------------------------------------

    async def publish(
        self,
        run: RunDocument,
        kind: MessageKind,
        *,
        resume: ResumeCopy | None = None,
        sweep: int | None = None,
        traceparent: str | None = None,
        expect_new: bool = True,
    ) -> PubAck:
        """Publish the run's current attempt with bounded retries (tenacity). A retry after a
        lost ack dedupes on `Nats-Msg-Id`; a *first* try answered `duplicate` means the id was
        used before, which for a new attempt is an error (`DuplicatePublication`). The
        sweeper's republish of a missing publication passes `expect_new=False`: there a
        duplicate means the original landed, and its sequence is in the ack. On a cluster a try
        can find the id *in process* (`MSG_ID_IN_PROCESS`): a copy not yet committed, its
        own earlier try's or another publisher's; it is asked again, and such a try does not
        count as one that could have stored our copy when a duplicate is judged."""
        message = RunMessage(
            run_id=run.run_id,
            tenant=run.tenant,
            attempt=run.attempt,
            kind=kind,
            published_at=utcnow(),
            resume=resume,
        )
        body, headers = encode(message, traceparent=traceparent, sweep=sweep)
        tries = 0
        in_process = 0
        stream_seen = False  # the stream answered its info after a publish nobody took

        async def send() -> PubAck:
            nonlocal tries, in_process, stream_seen
            tries += 1
            try:
                return await self.js.publish(
                    self.names.runs_subject,
                    body,
                    timeout=self.settings.publish_timeout.total_seconds(),
                    stream=self.names.runs_stream,
                    headers=headers,
                )
            except NoStreamResponseError:
                stream_seen = await self._unless_stream_missing() or stream_seen
                raise
            except APIError as exc:
                in_process += msg_id_in_process(exc)
                raise

        started = time.monotonic()
        try:
            try:
                # The first try without the retry machinery: building and stepping tenacity's
                # loop was ≈ 15 % of a launch's CPU (issue 19's profile), and nearly every
                # publish succeeds at once.
                ack = await send()
            except Exception as exc:
                left = self.settings.publish_retry_budget.total_seconds()
                left -= time.monotonic() - started
                if not publish_retryable(exc) or self.settings.publish_attempts < 2 or left <= 0:
                    raise
                ack = await self._retry(send, left)
        except (*PUBLISH_RETRYABLE, nats.errors.Error) as exc:
            # Every nats-py error of a publish (an APIError too) is a failed publish: the caller
            # puts the run back. The remedy says what to fix (a missing stream, a timeout...).
            cause = translate_nats_error(exc)
            if isinstance(exc, NoStreamResponseError):
                # Not "the stream is missing": the probe after each such try would have said
                # so (404) and ended the tries. The stream is there and unled, or JetStream
                # itself does not answer.
                why = (
                    "the stream answers, but no server took the publish (its leader just"
                    " elected, or moving)"
                    if stream_seen
                    else "JetStream did not answer for it either"
                )
                cause = JetStreamUnavailable(
                    f"no server took the message for stream {self.names.runs_stream}: {why}"
                    " (a NATS cluster starting, or electing after a node left; or JetStream not"
                    " enabled)"
                )
            raise PublishFailed(
                f"run {run.run_id}: publishing attempt {run.attempt} failed after {tries}"
                f" tries: {cause.message}",
                remedy=cause.remedy,
            ) from exc
        if ack.duplicate and tries - in_process == 1 and expect_new:
            raise DuplicatePublication(
                f"run {run.run_id}: {msg_id(run.run_id, run.attempt)} was already published"
            )
        if ack.duplicate:
            # Evidence for operators (and the cluster soak's count): the copy had landed, a
            # retry or a sweep was answered by the dedupe window instead of stored twice.
            log.info(
                "run %s: publication of attempt %d answered duplicate (seq %d, try %d)",
                run.run_id,
                run.attempt,
                ack.seq,
                tries,
            )
        return ack

    async def _unless_stream_missing(self) -> bool:
        """After "no stream took the message": a stream that does not exist is said at once
        (JetStream's 404 `stream not found` propagates, not retried), since the publish would
        fail every try; anything else (a stream whose leader is being elected answers nothing
        for a few seconds on a cluster) leaves the publish to be tried again. True when the
        stream answered its info (it exists: the publish met an election)."""
        try:
            await asyncio.wait_for(self.js.stream_info(self.names.runs_stream), _PROBE_S)
        except APIError as exc:
            if is_stream_missing(exc):
                raise
        except (nats.errors.Error, TimeoutError):
            pass
        else:
            return True
        return False

    async def _retry(self, send: Callable[[], Awaitable[PubAck]], left: float) -> PubAck:
        """Tries 2 … `publish_attempts` after a first one that failed retryably, on the
        schedule one tenacity loop over all of them keeps: 0.1 s, then doubling up to 2 s, and
        no retry after a try that failed once `publish_retry_budget` (`left` of it now) had
        passed."""
        await asyncio.sleep(_FIRST_WAIT_S)
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(self.settings.publish_attempts - 1)
            | stop_after_delay(max(left - _FIRST_WAIT_S, 0.0)),
            wait=wait_exponential(multiplier=2 * _FIRST_WAIT_S, max=2.0),
            retry=retry_if_exception(publish_retryable),
            reraise=True,
        ):
            with attempt:
                return await send()
        raise AssertionError("tenacity's loop ends in a result or the last error")

    async def record_publication(
        self, run: RunDocument, ack: PubAck, *, sweep: int | None = None, at: datetime | None = None
    ) -> RunDocument | None:
        """Record the copy that carries the run (no version bump). Skipped when a claim already
        recorded its own delivery of this attempt, or the attempt moved on."""
        result = await self.store.update_run(
            run.run_id,
            [Eq("attempt", run.attempt), Ne("publication.stream_seq", ack.seq)],
            Update(
                set={
                    "publication": {
                        "attempt": run.attempt,
                        "stream_seq": ack.seq,
                        "at": at or utcnow(),
                        "msg_id": msg_id(run.run_id, run.attempt, sweep),
                    }
                },
                bump_version=False,
            ),
        )
        return None if isinstance(result, CasConflict) else result

    # -- launch ------------------------------------------------------------------------------

    async def launch(
        self,
        loaded: LoadedWorkflow,
        inputs: dict[str, Any],
        *,
        tenant: str,
        run_id: str | None = None,
        attachments: Sequence[StagedFile] = (),
        traceparent: str | None = None,
    ) -> RunDocument:
        """`attachments` were promoted to `run_id` before this call (SPEC §4, §8): the run
        document lists them from its creation. `traceparent`: the caller's W3C trace context,
        carried on the message (SPEC §3)."""
        from engine.local import new_run_id

        resolve_vars(loaded.workflow, inputs)
        now = utcnow()
        doc = RunDocument(
            run_id=run_id or new_run_id(),
            tenant=tenant,
            origin=Origin.FLEET,
            workflow=WorkflowRef(
                name=loaded.workflow.name, source=loaded.source, source_hash=loaded.source_hash
            ),
            inputs=inputs,
            budget=loaded.workflow.budget.to_store(),
            status=RunStatus.QUEUED,
            attachments=list(attachments),
            attempt=1,
            attempt_at=now,
            created_at=now,
            updated_at=now,
        )
        # One awaited write: the document with `run_launched` and `run_queued` (issue 19
        # lever 3); then one awaited publish.
        await self.store.create_run(
            doc,
            events=[
                EventDraft("run_launched", {"workflow": loaded.workflow.name}, attempt=1),
                EventDraft("run_queued", {"attempt": 1, "kind": "launch"}, attempt=1),
            ],
        )
        try:
            ack = await self.publish(doc, "launch", traceparent=traceparent)
        except (PublishFailed, DuplicatePublication) as exc:
            failed = await self.store.update_run(
                doc.run_id,
                [Eq("status", RunStatus.QUEUED), Eq("attempt", 1), Ne("publication.attempt", 1)],
                Update(
                    set={
                        "status": RunStatus.FAILED,
                        "failure_code": FailureCode.LAUNCH_FAILED.value,
                        "error": exc.message,
                    }
                ),
            )
            if isinstance(failed, CasConflict) and failed.current is not None:
                # A copy landed after all (its PubAck was lost) and a runner claimed it: the
                # run is alive, so the launch succeeded — never report a failure it isn't.
                log.warning("run %s: publish reported %s, but a copy landed", doc.run_id, exc)
                return failed.current
            await self.store.append_event(
                doc.run_id,
                "run_failed",
                {"code": FailureCode.LAUNCH_FAILED.value, "error": exc.message},
                attempt=1,
            )
            raise
        # The publication record is written later, without the producer waiting for it, and
        # only if no claim has recorded this copy first (`launch_records`, SPEC §5.7's
        # missing-publication rule covering a record never written; the protocol model's
        # `launch_record` rule). The answer says which copy carries the run, as the record will.
        at = utcnow()
        self.launch_records.add(doc, ack, at)
        publication = Publication(
            attempt=1, stream_seq=ack.seq, at=at, msg_id=msg_id(doc.run_id, 1)
        )
        return doc.model_copy(update={"publication": publication})

    async def flush(self) -> None:
        """Write the publication records `launch` left pending now (before closing the store)."""
        await self.launch_records.flush()

    # -- resume and replay --------------------------------------------------------------------

    async def get_run(self, run_id: str, tenant: str) -> RunDocument:
        """The run, as `RunNotFound` when it belongs to another tenant."""
        run = await self.store.get_run(run_id)
        if run.tenant != tenant:
            raise RunNotFound(f"no run {run_id!r}")  # another tenant's run does not exist here
        return run

    async def resume(
        self,
        run_id: str,
        request: ResumeRequest,
        *,
        tenant: str,
        kind: Literal["resume", "replay"] = "resume",
        dlq_record: int | None = None,
        traceparent: str | None = None,
    ) -> RunDocument:
        """Judge (refusals in SPEC §4 order), queue by one CAS on the status and attempt read,
        publish, record. The loser of two concurrent resumes gets `run_not_resumable`."""
        run = await self.get_run(run_id, tenant)
        spec = judge_resume(run, request).model_copy(
            update={"kind": kind, "dlq_record": dlq_record}
        )
        copy = ResumeCopy.of(spec)
        self._check_fits(run, spec.attempt, kind, copy)
        now = utcnow()
        result = await self.store.update_run(
            run_id,
            [Eq("status", run.status), Eq("attempt", run.attempt)],
            Update(
                set={
                    "status": RunStatus.QUEUED,
                    "attempt": spec.attempt,
                    "attempt_at": now,
                    "resume_spec": spec.model_dump(),
                    "cancel_requested": False,
                    "origin": Origin.FLEET,
                }
            ),
            # The events ride with the CAS that makes them true (ADR-0014), as a launch's do:
            # appended after the publish, they took sequence numbers after the claiming
            # runner's, even after `run_finished` (found by a workflow walkthrough). SPEC §6.3:
            # `run_resumed {from_status}` as a local resume says it.
            events=[
                EventDraft(
                    "run_resumed", {"from_status": str(spec.prior_status)}, attempt=spec.attempt
                ),
                EventDraft(
                    "run_queued", {"attempt": spec.attempt, "kind": kind}, attempt=spec.attempt
                ),
            ],
        )
        if isinstance(result, CasConflict):
            current = result.current or run
            judge_resume(current, request)  # re-judge: it may now be refused for a reason
            from engine.refusals import RunNotResumable

            raise RunNotResumable(run_id, f"{current.status} (another operation won the race)")
        try:
            # `expect_new=False`: the attempt is new by its CAS, so the only copy that can hold
            # its `Nats-Msg-Id` already is the sweeper's republish of this very attempt (a
            # resume stalled past the grace between its CAS and its publish; found by the
            # protocol model). Its copy carries the attempt: queued, not failed.
            ack = await self.publish(
                result, kind, resume=copy, expect_new=False, traceparent=traceparent
            )
        except PublishFailed as exc:
            await self.flip_back(result, spec.prior_status, exc.message)
            raise
        await self.record_publication(result, ack)
        return await self.store.get_run(run_id)

    def _check_fits(
        self, run: RunDocument, attempt: int, kind: MessageKind, copy: ResumeCopy
    ) -> None:
        """`ResumeTooLarge` when the message this resume would publish is over the server's
        `max_payload` (the client refuses it, every time)."""
        limit = self.nc.max_payload
        if not limit:
            return
        message = RunMessage(
            run_id=run.run_id,
            tenant=run.tenant,
            attempt=attempt,
            kind=kind,
            published_at=utcnow(),
            resume=copy,
        )
        body, headers = encode(message)
        size = len(body) + sum(len(k) + len(v) + 4 for k, v in (headers or {}).items()) + 64
        if size > limit:
            raise ResumeTooLarge(
                f"run {run.run_id}: the resume's message would be {len(body)} bytes, over the"
                f" NATS server's max_payload ({limit} bytes)"
            )

    async def flip_back(self, run: RunDocument, prior: RunStatus, reason: str) -> None:
        """A failed publish puts the run back where it was; the attempt stays (never
        decreases), so any copy that did land is superseded."""
        result = await self.store.update_run(
            run.run_id,
            [
                Eq("status", RunStatus.QUEUED),
                Eq("attempt", run.attempt),
                Ne("publication.attempt", run.attempt),
            ],
            Update(set={"status": prior}),
        )
        if isinstance(result, CasConflict):
            log.warning("run %s: could not flip back after a failed publish", run.run_id)
            return
        await self.store.append_event(
            run.run_id,
            "run_requeue_failed",
            {"reason": reason, "back_to": str(prior)},
            attempt=run.attempt,
        )

    async def replay(self, record_id: int, *, tenant: str) -> RunDocument:
        """Replay a DLQ record through the resume path (SPEC §4 Replay; `publisher.replay`):
        the record goes only once the replay's publication is recorded, and a replay that
        stopped half-way (killed, or its publish failed) is finished by the next one."""
        return await replay_record(self, record_id, tenant=tenant)

    # -- cancel ------------------------------------------------------------------------------

    async def cancel(
        self, run_id: str, *, tenant: str, skew: timedelta | None = None
    ) -> RunDocument:
        """SPEC §4 Cancel (`publisher.cancel`), with the control subject's signal."""
        skew = skew if skew is not None else self.settings.lease_skew
        return await cancel_run(self.store, run_id, tenant=tenant, skew=skew, signal=self._signal)

    async def _signal(self, run_id: str) -> None:
        try:
            await self.nc.publish(self.names.control_subject(run_id), b"cancel")
        except nats.errors.Error:
            log.warning("run %s: control signal not sent; the refresh will see it", run_id)
