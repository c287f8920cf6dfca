"""Consistency of what the operator surface says (issue 17 item 7; SPEC §6.7, §10): one remedy
per refusal that no other refusal contradicts, a replay refused for a record with no run names
`dlq purge`, the events read as a story (`run_queued` before the claim of its attempt), one
timestamp format (`Z`) in every `--json` document, `dlq show` as a table.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import pytest

from engine.refusals import NEXT_STEP, RewindRefused, RunNotResumable
from engine.resume import ResumeRequest
from publisher import DlqStore, RecordNotReplayable
from runner import operations as ops
from runner.cli.dlq import detail_lines, detail_view, record_view
from runner.cli.views import run_view
from runner.delivery_log import DeliveryEntry
from runner.operations import Env, is_refusal
from runner.operations.errors import RunIdAmbiguous
from runner.operations.run_ids import MIN_PREFIX
from runner.operations.runs import merge_timeline
from store import Event, Lease, RunNotFound, RunStatus, utcnow
from tests.operations.test_dlq import poison, record_for
from tests.publisher.conftest import put_run


async def test_resume_and_rewind_of_a_finished_run_refuse_with_one_remedy_that_agrees(
    env: Env,
) -> None:
    """SPEC §6.7 does not rewind a finished run, so neither refusal may suggest it."""
    done = await put_run(env.store, status=RunStatus.FINISHED)

    with pytest.raises(RunNotResumable) as resumed:
        await ops.resume(env, done.run_id, ResumeRequest())
    with pytest.raises(RewindRefused) as rewound:
        await ops.rewind(env, done.run_id, "greet")

    assert resumed.value.remedy == rewound.value.remedy == NEXT_STEP["finished"]
    assert "runfleet launch" in NEXT_STEP["finished"]
    assert "rewound" not in str(resumed.value.remedy).replace("neither resumed nor rewound", "")


async def test_resume_of_a_running_run_no_runner_holds_names_the_way_out(env: Env) -> None:
    """A run left `running` with its lease expired (a disk-full drill left some so for good):
    "it is already running" named no way out; the refusal says nothing holds it and how it
    moves again. A run a runner holds keeps the plain answer."""
    expired = Lease(owner="r", token="t", attempt=1, expires_at=utcnow() - timedelta(minutes=5))
    orphan = await put_run(env.store, status=RunStatus.RUNNING, lease=expired)
    held = Lease(owner="r", token="u", attempt=1, expires_at=utcnow() + timedelta(minutes=5))
    busy = await put_run(env.store, status=RunStatus.RUNNING, lease=held)

    with pytest.raises(RunNotResumable) as orphaned:
        await ops.resume(env, orphan.run_id, ResumeRequest())
    with pytest.raises(RunNotResumable) as running:
        await ops.resume(env, busy.run_id, ResumeRequest())

    assert "no runner holds it" in orphaned.value.message
    remedy = str(orphaned.value.remedy)
    assert "`runfleet cancel RUN` then `runfleet resume RUN`" in remedy
    assert running.value.remedy == NEXT_STEP["running"]


async def test_resume_of_a_failed_run_points_at_a_rewind_that_is_then_allowed(env: Env) -> None:
    failed = await put_run(env.store, status=RunStatus.FAILED)

    with pytest.raises(RunNotResumable) as resumed:
        await ops.resume(env, failed.run_id, ResumeRequest())
    assert resumed.value.remedy is not None and "runfleet rewind" in resumed.value.remedy

    with pytest.raises(RewindRefused) as rewound:  # refused for the node, not the status
        await ops.rewind(env, failed.run_id, "no-such-node")
    assert "no node" in rewound.value.message
    assert rewound.value.remedy is not None and "runfleet status" in rewound.value.remedy


async def test_a_replay_refused_for_a_record_whose_run_is_gone_names_dlq_purge(
    env: Env, dlq: DlqStore
) -> None:
    run = await put_run(env.store, status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED")
    await record_for(dlq, run, 31)
    await poison(dlq, 32)
    await env.store.delete_run(run.run_id)

    report = await ops.replay_records(env, [31, 32])

    for outcome in report.outcomes:
        assert isinstance(outcome.error, RecordNotReplayable), outcome
        assert outcome.error.remedy is not None and "dlq purge" in outcome.error.remedy
    assert report.stopped_by is None


async def test_events_show_run_queued_before_the_run_claimed_of_its_attempt(env: Env) -> None:
    """The publisher appends `run_queued` after the PubAck; a runner may claim first."""
    run = await put_run(env.store, status=RunStatus.RUNNING)
    for kind, attempt in (
        ("run_launched", 1),
        ("run_claimed", 1),  # the runner was quicker than the publisher's append
        ("run_queued", 1),
        ("node_started", 1),
        ("run_queued", 2),  # a handoff: queued before its claim, left alone
        ("run_claimed", 2),
    ):
        await env.store.append_event(run.run_id, kind, {"attempt": attempt}, attempt=attempt)

    (batch,) = [b async for b in ops.event_batches(env, run.run_id)]

    assert [(e.type, e.attempt) for e in batch] == [
        ("run_launched", 1),
        ("run_queued", 1),
        ("run_claimed", 1),
        ("node_started", 1),
        ("run_queued", 2),
        ("run_claimed", 2),
    ]
    assert sorted(e.seq for e in batch) == list(range(1, 7))  # every event, its seq kept


_INSTANT = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")


def instants(value: Any, path: str = "") -> list[tuple[str, str]]:
    """Every (path, string) in a JSON document that reads as a timestamp."""
    if isinstance(value, dict):
        return [i for k, v in value.items() for i in instants(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [i for n, v in enumerate(value) for i in instants(v, f"{path}[{n}]")]
    if isinstance(value, str) and _INSTANT.match(value):
        return [(path, value)]
    return []


async def test_every_timestamp_in_a_json_document_is_utc_with_z(env: Env, dlq: DlqStore) -> None:
    run = await put_run(
        env.store,
        status=RunStatus.RUNNING,
        lease=Lease(owner="r1", token="t", attempt=1, stream_seq=1, expires_at=utcnow()),
    )
    await record_for(dlq, run, 41)
    await env.store.append_event(run.run_id, "run_claimed", {}, attempt=1)
    documents = [
        run_view(run),
        record_view(await dlq.get(41)),
        detail_view(await ops.show_record(env, 41)),
        {"events": [e.model_dump(mode="json") for e in await env.store.read_events(run.run_id)]},
    ]
    seen = [i for doc in documents for i in instants(json.loads(json.dumps(doc, default=str)))]
    assert {path.rsplit(".", 1)[-1] for path, _ in seen} >= {
        "created_at",
        "updated_at",
        "expires_at",
        "at",
        "published_at",
    }
    assert [(p, v) for p, v in seen if not v.endswith("Z")] == []


async def test_dlq_show_without_json_is_a_table(env: Env, dlq: DlqStore) -> None:
    run = await put_run(env.store, status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED")
    await record_for(dlq, run, 51)
    await poison(dlq, 52)

    shown = detail_lines(detail_view(await ops.show_record(env, 51)))
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in shown)
    assert rows["record"] == "51"
    assert rows["run"].startswith(run.run_id)
    assert rows["run now"].startswith("failed_resumable DLQ_PARKED")
    assert any(line.startswith("body.kind") and "launch" in line for line in shown)
    assert not any(line.lstrip().startswith(("{", "}")) for line in shown)  # not a JSON dump

    poisoned = detail_lines(detail_view(await ops.show_record(env, 52)))
    assert any(line.startswith("body ") and "undecodable" in line for line in poisoned)
    (said,) = [line for line in poisoned if line.startswith("replayable")]
    assert "no: [record_not_replayable]" in said and "purge" in said


async def test_a_run_id_may_be_given_by_a_unique_prefix_of_at_least_6_characters(
    env: Env,
) -> None:
    first = await put_run(env.store, status=RunStatus.FINISHED)
    second = await put_run(env.store, status=RunStatus.FINISHED)
    third = await put_run(env.store, status=RunStatus.FAILED)
    ids = (first.run_id, second.run_id, third.run_id)
    shared = next(
        first.run_id[:n]
        for n in range(len(first.run_id), 0, -1)
        if all(i.startswith(first.run_id[:n]) for i in ids)
    )
    assert len(shared) >= MIN_PREFIX  # UUIDv7: the same millisecond-ish start
    unique = next(
        third.run_id[:n]
        for n in range(MIN_PREFIX, len(third.run_id) + 1)
        if not first.run_id.startswith(third.run_id[:n])
        and not second.run_id.startswith(third.run_id[:n])
    )

    assert (await ops.get_run(env, unique)).run_id == third.run_id
    await env.store.append_event(third.run_id, "run_failed", {}, attempt=1)
    (batch,) = [b async for b in ops.event_batches(env, unique)]
    assert [(e.run_id, e.type) for e in batch] == [(third.run_id, "run_failed")]
    with pytest.raises(RewindRefused, match="no node"):  # resolved, then judged
        await ops.rewind(env, unique, "no-such-node")
    with pytest.raises(RunNotResumable, match=third.run_id):
        await ops.resume(env, unique, ResumeRequest())

    with pytest.raises(RunIdAmbiguous) as ambiguous:
        await ops.get_run(env, shared)
    assert set(ambiguous.value.candidates) == {first.run_id, second.run_id, third.run_id}
    assert is_refusal(ambiguous.value)
    assert ambiguous.value.to_dict()["candidates"] == list(ambiguous.value.candidates)

    with pytest.raises(RunNotFound, match="no run"):  # too short, even where unique
        await ops.get_run(env, third.run_id[: MIN_PREFIX - 1] + "z")
    with pytest.raises(RunNotFound):
        await ops.get_run(env, "ffffffff")
    other = await put_run(env.store, status=RunStatus.FINISHED, tenant="other")
    with pytest.raises(RunNotFound):  # another tenant's run is not a candidate
        await ops.get_run(env, other.run_id[:-4])


async def test_the_merged_timeline_also_shows_run_queued_before_its_claim(env: Env) -> None:
    run = await put_run(env.store, status=RunStatus.RUNNING)
    for kind in ("run_launched", "run_claimed", "run_queued", "node_started"):
        await env.store.append_event(run.run_id, kind, {}, attempt=1)

    merged = merge_timeline(await env.store.read_events(run.run_id), [])

    assert [t.event.type for t in merged if t.event is not None] == [
        "run_launched",
        "run_queued",
        "run_claimed",
        "node_started",
    ]


def test_a_quick_resumes_events_and_deliveries_read_in_the_order_they_happened() -> None:
    """Found by an operator walkthrough: a fleet resume appends `run_resumed` and `run_queued`
    after its PubAck, and a quick run was claimed and finished first. The timeline read "ack
    finished" before "run_queued", and "run_resumed" after "run_finished": the moved events
    broke the merge's sort by time, and `run_resumed` was not moved at all."""
    t0 = utcnow()
    kinds = ("run_claimed", "node_started", "run_finished", "run_resumed", "run_queued")
    events = [
        Event(run_id="r", seq=n, type=kind, attempt=2, at=t0 + timedelta(milliseconds=10 * n))
        for n, kind in enumerate(kinds, start=1)
    ]  # claimed at +10 ms … queued at +50 ms, appended after the PubAck

    def delivery(action: str, reason: str, ms: int) -> DeliveryEntry:
        when = t0 + timedelta(milliseconds=ms)
        return DeliveryEntry(
            run_id="r",
            stream_seq=16,
            num_delivered=1,
            attempt=2,
            action=action,
            reason=reason,
            runner="r",
            at=when,
        )

    merged = merge_timeline(
        events, [delivery("claim", "fresh", 11), delivery("ack", "finished", 31)]
    )

    shown = [t.event.type if t.event else f"d:{t.delivery.action}" for t in merged]  # type: ignore[union-attr]
    assert shown == [
        "run_resumed",
        "run_queued",
        "run_claimed",
        "d:claim",
        "node_started",
        "run_finished",
        "d:ack",
    ], shown
