"""The DLQ operations without the CLI (issue 20 item 2): list, show, replay, select and purge,
against the real DLQ stream and a real SQLite store; the records are written as a runner
writes them (`DlqStore.put`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from nats.js import JetStreamContext

from publisher import (
    DlqRecord,
    DlqStore,
    PublishFailed,
    RecordNotFound,
    RunMessage,
    WireNames,
    encode,
)
from publisher import dlq as dlq_module
from publisher.errors import StreamNotFound
from runner import operations as ops
from runner.operations import Env, is_unreachable
from store import RunDocument, RunStatus, utcnow
from tests.publisher.conftest import Nats, put_run, stream_messages

POISON = b"\xff not a message"


async def parked(env: Env) -> RunDocument:
    return await put_run(
        env.store, status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED", attempt=2
    )


async def record_for(dlq: DlqStore, run: RunDocument, seq: int) -> DlqRecord:
    message = RunMessage(
        run_id=run.run_id,
        tenant=run.tenant,
        attempt=run.attempt,
        kind="launch",
        published_at=utcnow(),
    )
    body, headers = encode(message)
    return await dlq.put(
        seq=seq,
        body=body,
        headers=headers,
        reason="retries_exhausted",
        run_id=run.run_id,
        attempt=run.attempt,
        num_delivered=2,
    )


async def poison(dlq: DlqStore, seq: int) -> DlqRecord:
    return await dlq.put(seq=seq, body=POISON, headers={}, reason="malformed", replayable=False)


async def ids_left(dlq: DlqStore) -> list[int]:
    return [r.id for r in await dlq.list()]


async def test_list_records_filters_by_reason_and_age(env: Env, dlq: DlqStore) -> None:
    run = await parked(env)
    await record_for(dlq, run, 11)
    await poison(dlq, 12)

    assert [r.id for r in await ops.list_records(env)] == [11, 12]
    assert [r.id for r in await ops.list_records(env, reason="malformed")] == [12]
    assert await ops.list_records(env, older_than=timedelta(hours=1)) == []


async def test_the_dlq_is_listed_in_batches_by_id_and_leaves_no_consumer_behind(
    env: Env, dlq: DlqStore, nats_conn: Nats, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`list` reads the stream through an ephemeral consumer a batch at a time (it asked for
    one message a round trip): every record once, in id order whatever order they were written
    in, across batch boundaries; a purged one is not there; and the consumer is deleted at the
    end, so a console refreshing its DLQ page does not pile them up."""
    monkeypatch.setattr(dlq_module, "_LIST_BATCH", 4)
    run = await parked(env)
    ids = [9, 3, 17, 1, 12, 5, 30, 2, 8, 21]
    for record_id in ids:
        await record_for(dlq, run, record_id)
    assert await dlq.delete(12)
    one_at_a_time = count_get_msg(dlq, monkeypatch)

    listed = await dlq.list()

    assert [r.id for r in listed] == sorted(set(ids) - {12})
    assert all(r.run_id == run.run_id for r in listed)
    assert one_at_a_time == [1]  # only the leader's "nothing after these" (it was one a record)
    consumers = await nats_conn.js.consumers_info(dlq.names.dlq_stream)
    assert consumers == []


def count_get_msg(dlq: DlqStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`[calls]` of `get_msg` on `dlq`'s JetStream context, counted as they happen."""
    calls = [0]
    real = dlq.js.get_msg

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await real(*args, **kwargs)

    monkeypatch.setattr(dlq.js, "get_msg", counted)
    return calls


async def test_records_deleted_while_the_dlq_is_listed_end_the_listing_not_fail_it(
    env: Env, dlq: DlqStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bulk replay or purge deletes records while a console lists the DLQ: the consumer's
    pending count, read before, is then too high, and its fetch finds nothing. The listing
    ends with what is left (a review found it failed with a NATS timeout after 5 s)."""
    run = await parked(env)
    for record_id in (1, 2, 3, 4):
        await record_for(dlq, run, record_id)
    real_fetch = JetStreamContext.PullSubscription.fetch

    async def purged_first(self: Any, *args: Any, **kwargs: Any) -> Any:
        for record_id in (1, 2, 3, 4):
            await dlq.delete(record_id)
        return await real_fetch(self, *args, **kwargs)

    monkeypatch.setattr(JetStreamContext.PullSubscription, "fetch", purged_first)
    assert await dlq.list() == []  # 4 pending when counted, none left to fetch


async def test_what_the_consumer_did_not_deliver_is_read_from_the_leader(
    env: Env, dlq: DlqStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An R1 consumer on a replicated DLQ stream may sit on a follower the newest records have
    not reached: the listing reads on from the leader after the last record it was given."""
    run = await parked(env)
    for record_id in (4, 1, 7):
        await record_for(dlq, run, record_id)
    real = DlqStore._read_through_consumer

    async def lagging(self: DlqStore) -> Any:
        return (await real(self))[:1]  # a follower that had the first record only

    monkeypatch.setattr(DlqStore, "_read_through_consumer", lagging)
    assert [r.id for r in await dlq.list()] == [1, 4, 7]


async def test_show_record_decodes_the_body_where_it_can_and_reads_the_run(
    env: Env, dlq: DlqStore
) -> None:
    run = await parked(env)
    await record_for(dlq, run, 21)
    await poison(dlq, 22)
    gone = await put_run(env.store, status=RunStatus.FAILED_RESUMABLE)
    await record_for(dlq, gone, 23)
    await env.store.delete_run(gone.run_id)

    good = await ops.show_record(env, 21)
    assert good.message is not None and good.message.run_id == run.run_id
    assert good.run is not None and good.run.failure_code == "DLQ_PARKED"
    bad = await ops.show_record(env, 22)
    assert (bad.message, bad.body, bad.run, bad.run_missing) == (None, POISON, None, False)
    assert bad.undecodable
    assert (await ops.show_record(env, 23)).run_missing
    with pytest.raises(RecordNotFound):
        await ops.show_record(env, 24)


async def test_show_record_whose_body_blob_is_lost_still_shows_the_record_and_its_run(
    env: Env, nats_conn: Nats, names: WireNames
) -> None:
    """A body over 256 KiB lives in the blob store; when that blob is gone the record still
    says what died and why (an on-call walkthrough: `dlq show` exit 1, the API a 500)."""
    dlq = DlqStore(nats_conn.js, names, env.blobs)
    run = await parked(env)
    big = b"x" * (300 * 1024)
    record = await dlq.put(
        seq=25, body=big, headers={}, reason="malformed", run_id=run.run_id, replayable=False
    )
    assert record.body_key is not None
    await env.blobs.delete(record.body_key)

    shown = await ops.show_record(env, 25)

    assert (shown.body, shown.message) == (b"", None)
    assert shown.undecodable and "missing from the blob store" in shown.undecodable
    assert shown.run is not None and shown.run.run_id == run.run_id


async def test_replay_records_replays_each_and_refuses_per_record(
    env: Env, dlq: DlqStore, nats_conn: Nats, names: WireNames
) -> None:
    run = await parked(env)
    await record_for(dlq, run, 31)
    await poison(dlq, 32)

    report = await ops.replay_records(env, None)

    replayed, refused = report.outcomes
    assert (replayed.record_id, replayed.replayed) == (31, True)
    assert replayed.run is not None and replayed.run.attempt == 3
    assert refused.record_id == 32 and refused.error is not None
    assert refused.error.code == "record_not_replayable"
    assert (report.stopped_by, report.not_attempted) == (None, ())
    assert await ids_left(dlq) == [32]
    assert len(await stream_messages(nats_conn.js, names)) == 1


async def test_replay_records_stops_at_unreachable_infrastructure_and_keeps_every_record(
    env: Env, dlq: DlqStore, nats_conn: Nats, names: WireNames
) -> None:
    first, second = await parked(env), await parked(env)
    await record_for(dlq, first, 41)
    await record_for(dlq, second, 42)
    await nats_conn.js.delete_stream(names.runs_stream)

    report = await ops.replay_records(env, [41, 42])

    (failed,) = report.outcomes
    assert failed.record_id == 41 and isinstance(failed.error, PublishFailed)
    assert report.stopped_by is failed.error and is_unreachable(failed.error)
    assert report.not_attempted == (42,)
    assert await ids_left(dlq) == [41, 42]
    assert (await env.store.get_run(second.run_id)).attempt == 2  # never touched


async def test_select_then_purge_removes_only_the_selected_records(env: Env, dlq: DlqStore) -> None:
    run = await parked(env)
    await record_for(dlq, run, 51)
    await poison(dlq, 52)
    await poison(dlq, 53)

    selected = await ops.select_records(env, None, reason="malformed")
    assert [r.id for r in selected] == [52, 53]
    assert [r.id for r in await ops.select_records(env, [51])] == [51]
    with pytest.raises(RecordNotFound):
        await ops.select_records(env, [59])

    assert await ops.purge_records(env, [52, 53, 59]) == [52, 53]
    assert await ids_left(dlq) == [51]


async def test_an_operation_meeting_a_missing_stream_raises_stream_not_found(
    env: Env, nats_conn: Nats, names: WireNames
) -> None:
    await nats_conn.js.delete_stream(names.dlq_stream)
    for call in (
        ops.list_records(env),
        ops.show_record(env, 1),
        ops.select_records(env, [1]),
        ops.purge_records(env, [1]),
    ):
        with pytest.raises(StreamNotFound) as info:
            await call
        assert is_unreachable(info.value)
        assert "runfleet streams ensure" in (info.value.remedy or "")


async def test_a_record_that_does_not_read_is_listed_shown_and_purged_not_an_internal_error(
    env: Env, dlq: DlqStore
) -> None:
    """A message on the DLQ stream that is no `DlqRecord` (written by hand, or by another
    version) made every listing fail `internal` and could not be purged (found by a code
    review). It is listed as `unreadable_record` with its raw bytes as its body, never
    replayable, and purged like any record; the others list as before."""
    run = await parked(env)
    await record_for(dlq, run, 61)
    await dlq.js.publish(dlq.names.dlq_subject(62), b'{"id": "not a number"')

    listed = await ops.list_records(env)
    assert [r.id for r in listed] == [61, 62]
    bad = listed[1]
    assert bad.reason == "unreadable_record" and not bad.replayable and bad.run_id is None
    assert "does not read" in bad.detail
    assert [r.id for r in await ops.list_records(env, reason="unreadable_record")] == [62]

    detail = await ops.show_record(env, 62)
    assert detail.record.reason == "unreadable_record"
    assert b'{"id": "not a number"' in await dlq.body(detail.record)

    report = await ops.replay_records(env, [62])
    assert not report.outcomes[0].replayed
    assert await ops.purge_records(env, [62]) == [62]
    assert await ids_left(dlq) == [61]


async def test_the_record_a_parked_run_waits_on_is_read_from_its_newest_events(
    env: Env, dlq: DlqStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`status` of a `DLQ_PARKED` run names the record to replay. It used to read the run's
    whole history for the `run_dlq_parked` event at its attempt; the event is among the last
    few, so one page from the newest back finds it, whatever came before."""
    run = await parked(env)
    earlier = await record_for(dlq, run, 3)
    await env.store.append_event(run.run_id, "run_dlq_parked", {"record_id": earlier.id}, attempt=1)
    for i in range(40):
        await env.store.append_event(run.run_id, "node_started", {"node": f"n{i}"}, attempt=2)
    record = await record_for(dlq, run, 7)
    await env.store.append_event(run.run_id, "run_dlq_parked", {"record_id": record.id}, attempt=2)
    pages: list[int] = []
    for name in ("read_events", "read_events_before"):
        real = getattr(env.store, name)

        async def counted(*args: object, _real: Any = real, **kwargs: object) -> Any:
            got = await _real(*args, **kwargs)
            pages.append(len(got))
            return got

        monkeypatch.setattr(env.store, name, counted)

    assert await ops.parked_record_id(env, run) == record.id
    assert len(pages) == 1 and pages[0] < 42  # the newest page only, not the whole history

    older = run.model_copy(update={"attempt": 1})  # what the run was at its first park
    pages.clear()
    assert await ops.parked_record_id(env, older) == earlier.id
    assert sum(pages) == 42  # back through the whole history to the attempt-1 park
