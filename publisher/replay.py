"""Replay of a DLQ record (SPEC §4 Replay): a fresh attempt through the resume path; the record
goes only once the replay's publication is recorded.

A replay can stop anywhere: killed between its CAS and its publish, its publish failing after the
CAS (the run is flipped back to its prior status, SPEC §4 Resume), killed after the publish but
before the record goes. The run's `resume_spec` names the record its attempt replays, so the next
replay of the same record reads where the last one stopped (`replay_stage`, a pure function of
the run) and finishes the job: it publishes what was never published, replays anew what was put
back, removes the record of what did publish — and never removes a record whose replay did not
publish, nor replays a record twice.
"""

from __future__ import annotations

import contextlib
from enum import StrEnum
from typing import TYPE_CHECKING, Literal, Protocol

from engine.resume import ResumeRequest
from publisher.dlq import DlqRecord, DlqStore
from publisher.errors import PublishFailed, RecordNotReplayable, StaleRecord
from publisher.wire import MessageKind, ResumeCopy
from store import RunDocument, RunNotFound, RunStatus, RunStore
from store.events import events_newest_first

if TYPE_CHECKING:
    from nats.js.api import PubAck


class ReplayStage(StrEnum):
    """Where the last replay of a record left its run (the run document decides, nothing else)."""

    FRESH = "fresh"
    """No replay of this record wrote the run: replay it (if the record is still current)."""
    UNPUBLISHED = "unpublished"
    """`queued` at the replay's attempt with no publication for it: publish it now."""
    PUBLISHED = "published"
    """The replay's copy is recorded (or claimed, and the run moved on): only the record is
    left to remove."""
    FLIPPED_BACK = "flipped_back"
    """The replay's publish failed and the run was put back to its prior status: replay anew
    (a fresh attempt, so a copy of the failed one that landed late is superseded)."""
    OVERTAKEN = "overtaken"
    """Never published, and the run is neither queued nor put back (an operator cancelled it
    in between): the record is stale; a replay must never undo that."""


def replay_stage(run: RunDocument, record_id: int) -> ReplayStage:
    spec = run.resume_spec
    if spec is None or spec.kind != "replay" or spec.dlq_record != record_id:
        return ReplayStage.FRESH
    if run.attempt > spec.attempt:
        # Only a claim's handoff moves the attempt past a resume's without a new resume_spec:
        # the replay's copy was delivered.
        return ReplayStage.PUBLISHED
    if run.publication is not None and run.publication.attempt == run.attempt:
        return ReplayStage.PUBLISHED
    if run.status is RunStatus.QUEUED:
        return ReplayStage.UNPUBLISHED
    if run.status is spec.prior_status:
        return ReplayStage.FLIPPED_BACK
    return ReplayStage.OVERTAKEN


class ReplayPublisher(Protocol):
    """What a replay needs of the publisher (`publisher.publisher.Publisher`)."""

    store: RunStore
    dlq: DlqStore | None

    async def get_run(self, run_id: str, tenant: str) -> RunDocument:
        """The run, or `RunNotFound` when it belongs to another tenant."""
        ...

    async def resume(
        self,
        run_id: str,
        request: ResumeRequest,
        *,
        tenant: str,
        kind: Literal["resume", "replay"] = "resume",
        dlq_record: int | None = None,
    ) -> RunDocument:
        """Judge, queue by CAS, publish (flipping back on failure), record."""
        ...

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
        """Publish the run's current attempt with bounded retries; `PublishFailed` after."""
        ...

    async def record_publication(
        self, run: RunDocument, ack: PubAck, *, sweep: int | None = None
    ) -> RunDocument | None:
        """Record the copy that carries the run."""
        ...

    async def flip_back(self, run: RunDocument, prior: RunStatus, reason: str) -> None:
        """Put a queued run whose publish failed back to `prior` (SPEC §4 Resume)."""
        ...


def replay_refusal(
    record: DlqRecord, run: RunDocument | None
) -> RecordNotReplayable | StaleRecord | None:
    """Why a replay of `record` would be refused, judged on its run as read (None when the
    record names none or it is gone); None when the replay would go ahead as far as the record
    is concerned (the resume's own refusals come after). What `replay_record` raises, and what
    `dlq show` says before anyone tries (found by an operator walkthrough: it said
    "replayable yes" for a record whose replay was then refused `stale_record`)."""
    record_id = record.id
    purge = f"purge it (`runfleet dlq purge {record_id}`)"
    if record.run_id is None:
        return RecordNotReplayable(
            f"DLQ record {record_id} names no run to resume",
            remedy=f"{purge}: there is no run to replay it into",
        )
    if not record.replayable:
        # The message itself is the problem (a forged tenant, an attempt ahead of its run):
        # replaying it would deliver the same refusal again. Its run is judged on its own.
        why = f"{record.reason}: {record.detail}" if record.detail else record.reason
        return RecordNotReplayable(
            f"DLQ record {record_id} is not replayable ({why}); the message, not run"
            f" {record.run_id}, is what was refused",
            remedy=f"{purge}; resume run {record.run_id} itself if it should run again",
        )
    if run is None:
        # Its run was collected (or is not this tenant's): nothing to resume, and the remedy
        # is the record's own — purge it — not "check the run id".
        # Found by an operator walkthrough: after `RUNFLEET_TENANT` changed, "purge it" told
        # them to destroy a parked run's only way back.
        return RecordNotReplayable(
            f"DLQ record {record_id}: its run {record.run_id} is not in the store for this"
            " tenant (another tenant's run, or one `runfleet gc` collected)",
            remedy="if the run is another tenant's, replay the record with RUNFLEET_TENANT set to"
            f" that tenant; if the run was collected, {purge}",
        )
    stage = replay_stage(run, record_id)
    if stage is ReplayStage.OVERTAKEN:
        return StaleRecord(
            f"DLQ record {record_id}: its replay (attempt {run.attempt}) was never published, and"
            f" run {run.run_id} is {run.status} since"
        )
    if stage is ReplayStage.FRESH and run.status is RunStatus.CANCELLED:
        # The operator's cancel came after the record: a replay (`dlq replay --all` above all)
        # must not undo it; `runfleet resume` still can, on purpose (found by review).
        return StaleRecord(
            f"DLQ record {record_id}: run {run.run_id} was cancelled since; resume the run"
            " itself if it should run again"
        )
    if stage is ReplayStage.FRESH and record.attempt != run.attempt:
        return StaleRecord(
            f"DLQ record {record_id} is for attempt {record.attempt}; run {run.run_id} is"
            f" at attempt {run.attempt}"
        )
    return None


async def replay_record(pub: ReplayPublisher, record_id: int, *, tenant: str) -> RunDocument:
    """Replay one record; refusals (`record_not_found`, `record_not_replayable`,
    `stale_record`, the resume refusals) and a failed publish leave the record in place."""
    assert pub.dlq is not None, "replay needs a DLQ store"
    record = await pub.dlq.get(record_id)
    run: RunDocument | None = None
    if record.replayable and record.run_id is not None:
        with contextlib.suppress(RunNotFound):
            run = await pub.get_run(record.run_id, tenant)
    refusal = replay_refusal(record, run)
    if refusal is not None:
        raise refusal
    assert run is not None
    stage = replay_stage(run, record_id)
    if stage in (ReplayStage.FRESH, ReplayStage.FLIPPED_BACK):
        doc = await pub.resume(
            run.run_id, ResumeRequest(), tenant=tenant, kind="replay", dlq_record=record_id
        )
    else:
        doc = await _finish(pub, run, stage)
    await pub.dlq.delete(record_id)
    return doc


async def _finish(pub: ReplayPublisher, run: RunDocument, stage: ReplayStage) -> RunDocument:
    """Do what an interrupted replay did not get to: the publish (flipping the run back if it
    fails, as the resume path does) and its `run_queued`."""
    spec = run.resume_spec
    assert spec is not None
    if stage is ReplayStage.UNPUBLISHED:
        copy = ResumeCopy.of(spec)
        try:
            # A copy that did land (a lost PubAck) dedupes on its Nats-Msg-Id: not an error.
            ack = await pub.publish(run, "replay", resume=copy, expect_new=False)
        except PublishFailed as exc:
            await pub.flip_back(run, spec.prior_status, exc.message)
            raise
        await pub.record_publication(run, ack)
    await _ensure_queued_event(pub.store, run.run_id, spec.attempt)
    return await pub.store.get_run(run.run_id)


async def _ensure_queued_event(store: RunStore, run_id: str, attempt: int) -> None:
    """`run_queued` for `attempt`, unless one is there (events are a projection, §2)."""
    async for e in events_newest_first(store, run_id):
        if e.type == "run_queued" and e.data.get("attempt") == attempt:
            return  # most often the last event or near it: read from the newest back
    await store.append_event(
        run_id, "run_queued", {"attempt": attempt, "kind": "replay"}, attempt=attempt
    )
