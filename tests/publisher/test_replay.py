"""Replay after a failed publish (SPEC §4 Replay and Resume, issue 12 item 3), against the real
JetStream and a real store: a publish fails *after* the replay's CAS because the work stream is
gone (deleted, as an operator or a broken migration would), not because a mock says so.

A replay whose publish fails puts the run back and keeps its record; the next replay of that
record reads what the run actually is and publishes for real; the record goes only after the
replay's publication is recorded.
"""

from __future__ import annotations

from typing import Any

import pytest

from publisher import (
    DlqRecord,
    DlqStore,
    Publisher,
    PublishFailed,
    RecordNotFound,
    RecordNotReplayable,
    RunMessage,
    StaleRecord,
    WireNames,
    WireSettings,
    decode,
    encode,
    ensure_streams,
)
from publisher.replay import ReplayStage, replay_stage
from store import Publication, ResumeSpec, RunDocument, RunStatus, RunStore, utcnow
from tests.publisher.conftest import Nats, put_run, stream_count, stream_messages

RECORD = 17
PARKED: dict[str, Any] = {
    "status": RunStatus.FAILED_RESUMABLE,
    "failure_code": "DLQ_PARKED",
    "cause_code": "TOOL_FAILED_TRANSIENT",
}


async def dead_letter(dlq: DlqStore, run: RunDocument, *, attempt: int) -> DlqRecord:
    """The record a runner writes when `attempt`'s delivery budget ran out."""
    message = RunMessage(
        run_id=run.run_id, tenant=run.tenant, attempt=attempt, kind="launch", published_at=utcnow()
    )
    data, headers = encode(message)
    return await dlq.put(
        seq=RECORD,
        body=data,
        headers=headers,
        reason="retries_exhausted",
        run_id=run.run_id,
        attempt=attempt,
        num_delivered=2,
        runner="runner-a",
    )


def replay_spec(attempt: int, prior: RunStatus = RunStatus.FAILED_RESUMABLE) -> ResumeSpec:
    """The resume_spec a replay of RECORD writes with its CAS (then was interrupted)."""
    return ResumeSpec(
        attempt=attempt, prior_status=prior, kind="replay", dlq_record=RECORD, published_at=utcnow()
    )


def dlq_of(publisher: Publisher) -> DlqStore:
    assert publisher.dlq is not None
    return publisher.dlq


async def record_kept(publisher: Publisher) -> bool:
    try:
        await dlq_of(publisher).get(RECORD)
    except RecordNotFound:
        return False
    return True


async def queued_attempts(store: RunStore, run_id: str) -> list[int]:
    return [e.data["attempt"] for e in await store.read_events(run_id) if e.type == "run_queued"]


class RecordingDlq(DlqStore):
    """The real DLQ store, noting what the run looked like when each record was removed."""

    def __init__(self, inner: DlqStore, store: RunStore) -> None:
        super().__init__(inner.js, inner.names, inner.blobs)
        self.store = store
        self.removed_while: list[RunDocument] = []

    async def delete(self, record_id: int) -> bool:
        record = await self.get(record_id)
        assert record.run_id is not None
        self.removed_while.append(await self.store.get_run(record.run_id))
        return await super().delete(record_id)


async def test_a_replay_whose_publish_fails_after_its_cas_flips_the_run_back_and_keeps_the_record(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
) -> None:
    run = await put_run(run_store, attempt=2, **PARKED)
    await dead_letter(dlq_of(publisher), run, attempt=2)
    await nats_conn.js.delete_stream(names.runs_stream)  # the publish fails after the CAS

    with pytest.raises(PublishFailed) as info:
        await publisher.replay(RECORD, tenant="default")

    assert "runfleet streams ensure" in (info.value.remedy or "")
    after = await run_store.get_run(run.run_id)
    assert (after.status, after.failure_code) == (RunStatus.FAILED_RESUMABLE, "DLQ_PARKED")
    assert after.attempt == 3  # the replay's attempt stays: never decreases (SPEC §4 Resume)
    assert after.publication is None
    events = await run_store.read_events(run.run_id)
    # Queued for a moment by its CAS (its events ride with it), then put back.
    assert [e.type for e in events] == ["run_resumed", "run_queued", "run_requeue_failed"]
    assert events[-1].data["back_to"] == "failed_resumable"
    assert await record_kept(publisher)


async def test_a_second_replay_after_a_failed_publish_publishes_then_removes_the_record(
    publisher: Publisher,
    nats_conn: Nats,
    names: WireNames,
    run_store: RunStore,
    settings: WireSettings,
) -> None:
    run = await put_run(run_store, attempt=2, **PARKED)
    await dead_letter(dlq_of(publisher), run, attempt=2)
    await nats_conn.js.delete_stream(names.runs_stream)
    with pytest.raises(PublishFailed):
        await publisher.replay(RECORD, tenant="default")
    await ensure_streams(nats_conn.js, names, settings)  # the operator follows the remedy
    recording = RecordingDlq(dlq_of(publisher), run_store)
    publisher.dlq = recording

    replayed = await publisher.replay(RECORD, tenant="default")

    assert (replayed.status, replayed.attempt) == (RunStatus.QUEUED, 4)
    (message,) = await stream_messages(nats_conn.js, names)
    decoded = decode(message.data or b"", message.headers)
    assert (decoded.attempt, decoded.kind) == (4, "replay")
    assert replayed.publication is not None
    assert (replayed.publication.attempt, replayed.publication.stream_seq) == (4, message.seq)
    (seen,) = recording.removed_while  # the record went once, after the publication was recorded
    assert seen.publication is not None and seen.publication.attempt == 4
    assert not await record_kept(publisher)
    # Attempt 3 was queued by its CAS and put back when its publish failed; 4 went out.
    assert await queued_attempts(run_store, run.run_id) == [3, 4]


async def test_a_replay_found_queued_at_its_attempt_with_no_publication_is_published_not_skipped(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
) -> None:
    """A replay killed between its CAS and its publish left the run `queued` at the record's
    attempt + 1 with nothing on the queue: the next replay publishes that attempt."""
    run = await put_run(run_store, status=RunStatus.QUEUED, attempt=3, resume_spec=replay_spec(3))
    await dead_letter(dlq_of(publisher), run, attempt=2)
    assert replay_stage(run, RECORD) is ReplayStage.UNPUBLISHED

    replayed = await publisher.replay(RECORD, tenant="default")

    (message,) = await stream_messages(nats_conn.js, names)
    assert (message.headers or {})["Nats-Msg-Id"] == f"{run.run_id}:3"
    assert (replayed.status, replayed.attempt) == (RunStatus.QUEUED, 3)
    assert replayed.publication is not None and replayed.publication.attempt == 3
    assert not await record_kept(publisher)
    assert await queued_attempts(run_store, run.run_id) == [3]


async def test_an_interrupted_replay_whose_publish_fails_again_flips_back_and_keeps_the_record(
    publisher: Publisher,
    nats_conn: Nats,
    names: WireNames,
    run_store: RunStore,
    settings: WireSettings,
) -> None:
    run = await put_run(run_store, status=RunStatus.QUEUED, attempt=3, resume_spec=replay_spec(3))
    await dead_letter(dlq_of(publisher), run, attempt=2)
    await nats_conn.js.delete_stream(names.runs_stream)

    with pytest.raises(PublishFailed):
        await publisher.replay(RECORD, tenant="default")

    after = await run_store.get_run(run.run_id)
    assert (after.status, after.attempt, after.publication) == (
        RunStatus.FAILED_RESUMABLE,
        3,
        None,
    )
    assert replay_stage(after, RECORD) is ReplayStage.FLIPPED_BACK
    assert await record_kept(publisher)

    await ensure_streams(nats_conn.js, names, settings)
    replayed = await publisher.replay(RECORD, tenant="default")
    assert (replayed.status, replayed.attempt) == (RunStatus.QUEUED, 4)
    assert [
        (m.headers or {})["Nats-Msg-Id"] for m in await stream_messages(nats_conn.js, names)
    ] == [f"{run.run_id}:4"]
    assert not await record_kept(publisher)


async def test_a_replay_found_published_removes_the_record_without_publishing_again(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
) -> None:
    """Killed after the publication was recorded, before the record went."""
    publication = Publication(attempt=3, stream_seq=41, at=utcnow())
    run = await put_run(
        run_store,
        status=RunStatus.QUEUED,
        attempt=3,
        resume_spec=replay_spec(3),
        publication=publication,
    )
    await dead_letter(dlq_of(publisher), run, attempt=2)

    replayed = await publisher.replay(RECORD, tenant="default")

    assert await stream_count(nats_conn.js, names) == 0
    assert replayed.publication == publication
    assert not await record_kept(publisher)


async def test_concurrent_replays_of_one_record_queue_one_attempt_with_one_run_queued(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
) -> None:
    """Five replays of one record at once (an API walkthrough): the run got one `run_resumed`
    and four `run_queued` for the same attempt, since each loser "finished" the winner's
    replay before the winner's events were written. The events now ride with the CAS."""
    import asyncio

    run = await put_run(run_store, attempt=2, **PARKED)
    await dead_letter(dlq_of(publisher), run, attempt=2)

    outcomes = await asyncio.gather(
        *(publisher.replay(RECORD, tenant="default") for _ in range(5)), return_exceptions=True
    )

    assert any(isinstance(o, RunDocument) for o in outcomes), outcomes
    assert await queued_attempts(run_store, run.run_id) == [3]
    types = [e.type for e in await run_store.read_events(run.run_id)]
    assert types.count("run_resumed") == 1
    assert (await run_store.get_run(run.run_id)).attempt == 3
    assert len(await stream_messages(nats_conn.js, names)) == 1  # one copy: the rest dedupe
    assert not await record_kept(publisher)


async def test_a_replay_never_published_whose_run_was_cancelled_since_is_refused_stale(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
) -> None:
    """An operator cancelled the queued run before the replay's publish: replaying the record
    again must not undo the cancel, and must not drop the record as if it had replayed."""
    run = await put_run(
        run_store, status=RunStatus.CANCELLED, attempt=3, resume_spec=replay_spec(3)
    )
    await dead_letter(dlq_of(publisher), run, attempt=2)

    with pytest.raises(StaleRecord):
        await publisher.replay(RECORD, tenant="default")

    assert await run_store.get_run(run.run_id) == run
    assert await stream_count(nats_conn.js, names) == 0
    assert await record_kept(publisher)


async def test_a_replay_of_a_parked_run_an_operator_cancelled_since_is_refused_stale(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
) -> None:
    """Found by review: no replay was involved before the cancel, so the record still named
    the run's attempt, and `dlq replay` (`--all` above all) put the cancelled run back on the
    queue. The cancel stands; the record stays for a purge, and a resume can still bring the
    run back on purpose."""
    run = await put_run(run_store, attempt=2, **PARKED)
    await dead_letter(dlq_of(publisher), run, attempt=2)
    cancelled = await publisher.cancel(run.run_id, tenant="default")
    assert cancelled.status is RunStatus.CANCELLED and cancelled.attempt == 2

    with pytest.raises(StaleRecord, match="cancelled since"):
        await publisher.replay(RECORD, tenant="default")

    assert (await run_store.get_run(run.run_id)).status is RunStatus.CANCELLED
    assert await stream_count(nats_conn.js, names) == 0
    assert await record_kept(publisher)


async def test_a_refused_message_naming_a_live_run_is_not_replayable_for_its_own_reason(
    publisher: Publisher, run_store: RunStore
) -> None:
    """A forged tenant's record names a real, paused run: "has no run to resume" sat right
    under the line showing that run (an on-call walkthrough). The refusal now gives the
    record's reason and says the run itself can be resumed."""
    run = await put_run(run_store, status=RunStatus.PAUSED_WAITING_HUMAN)
    await dlq_of(publisher).put(
        seq=RECORD,
        body=b"{}",
        headers={},
        reason="tenant_mismatch",
        detail="message tenant 'evil' is not the run's",
        run_id=run.run_id,
        attempt=1,
        replayable=False,
    )
    with pytest.raises(RecordNotReplayable) as refused:
        await publisher.replay(RECORD, tenant="default")
    assert "tenant_mismatch: message tenant 'evil'" in refused.value.message
    assert "no run to resume" not in refused.value.message
    remedy = refused.value.remedy or ""
    assert f"runfleet dlq purge {RECORD}" in remedy and f"resume run {run.run_id}" in remedy
    assert await record_kept(publisher)


def test_a_record_whose_run_is_not_found_names_the_tenant_before_offering_a_purge() -> None:
    """An operator walkthrough: after `RUNFLEET_TENANT` changed, a parked run of the old
    tenant read as gone, and the remedy ("it can only be purge it") told them to destroy its
    only way back."""
    from publisher.dlq import DlqRecord
    from publisher.replay import replay_refusal
    from store import utcnow

    record = DlqRecord(
        id=7, run_id="01a2440c-0000", attempt=3, reason="max_deliveries", at=utcnow()
    )

    refusal = replay_refusal(record, None)

    assert refusal is not None and refusal.code == "record_not_replayable"
    assert "not in the store for this tenant" in refusal.message
    assert "RUNFLEET_TENANT" in (refusal.remedy or "")
    assert "can only be" not in (refusal.remedy or "")
