"""The fleet operations without the CLI (issue 20 item 2): streams ensure, one sweeper pass, and
garbage collection in its two steps, against the real nats-server and a real SQLite store."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from publisher import DlqStore, RecordNotFound, WireNames, WireSettings
from publisher.errors import NatsUnavailable
from runner import operations as ops
from runner.operations import Env
from store import BlobNotFound, CasConflict, Eq, RunNotFound, RunStatus, Update, utcnow
from tests.publisher.conftest import Nats, delete_streams, expired_lease, put_run
from tests.runner.conftest import eventually


async def _clock_past(stamp: datetime) -> None:
    """Stamps are whole milliseconds: a plan made in the same millisecond as a write would
    (rightly) not call that write older than its cutoff. Poll until the clock has moved on."""

    async def moved_on() -> bool:
        return utcnow() > stamp

    await eventually(moved_on, within=5, every=0.001)


async def test_ensure_wire_creates_the_streams_then_has_nothing_to_do(
    wire: WireSettings, nats_conn: Nats, names: WireNames
) -> None:
    await delete_streams(nats_conn.js, names)

    first = await ops.ensure_wire(wire)
    again = await ops.ensure_wire(wire)

    assert {names.runs_stream, names.advisory_stream, names.dlq_stream} <= set(first.created)
    assert (again.created, again.updated) == ([], [])


async def test_ensure_wire_with_nats_unreachable_is_nats_unavailable(
    wire: WireSettings,
) -> None:
    with pytest.raises(NatsUnavailable):
        await ops.ensure_wire(wire.model_copy(update={"nats_url": "nats://127.0.0.1:1"}))


async def test_sweep_runs_one_pass_and_reports_its_actions(env: Env) -> None:
    """A fleet run left `running` by a runner that vanished (lease expired, no copy on the
    queue) is failed RUNNER_LOST and republished by the pass (SPEC §5.9)."""
    lost = await put_run(env.store, status=RunStatus.RUNNING, lease=expired_lease())

    result = await ops.sweep(env)

    assert result.actions == {"runner_lost": 1}
    after = await env.store.get_run(lost.run_id)
    assert after.publication is not None and after.publication.attempt == after.attempt


async def test_plan_then_collect_garbage_deletes_settled_runs_their_blobs_and_old_records(
    env: Env, dlq: DlqStore
) -> None:
    old = await put_run(env.store, status=RunStatus.FINISHED)
    live = await put_run(env.store, status=RunStatus.PAUSED_OPERATOR)
    await env.blobs.put_bytes(f"runs/{old.run_id}/outputs/greet/1", b"x")
    # What executions on this host left per run (a SIGKILLed runner's workspace among them).
    for run in (old, live):
        for name in ("work", "scratch", "sandboxes", "attachments"):
            (env.data_dir / name / run.run_id / "left").mkdir(parents=True)
    record = await dlq.put(seq=61, body=b"x", headers={}, reason="malformed", replayable=False)
    await _clock_past(max(old.updated_at, record.at))  # "older than 0" is strictly before now

    none_yet = await ops.plan_gc(env, timedelta(days=1))
    plan = await ops.plan_gc(env, timedelta(0))

    assert none_yet.run_ids == ()
    assert plan.run_ids == (old.run_id,)  # the paused run is not settled: never collected
    report = await ops.collect_garbage(env, plan)
    assert (report.runs, report.dlq_records, report.dlq_error) == (1, 1, None)
    with pytest.raises(RunNotFound):
        await env.store.get_run(old.run_id)
    with pytest.raises(BlobNotFound):
        await env.blobs.get_bytes(f"runs/{old.run_id}/outputs/greet/1")
    with pytest.raises(RecordNotFound):
        await dlq.get(61)
    assert (await env.store.get_run(live.run_id)).status is RunStatus.PAUSED_OPERATOR
    for name in ("work", "scratch", "sandboxes", "attachments"):
        assert not (env.data_dir / name / old.run_id).exists(), name
        assert (env.data_dir / name / live.run_id / "left").is_dir(), name


async def test_collect_garbage_spares_a_planned_run_that_was_resumed_before_the_deletion(
    env: Env,
) -> None:
    """Found by review: `runfleet gc` asks for confirmation between the plan and the deletion;
    a cancelled run resumed meanwhile was deleted while `queued` (with its attachments), and
    its copy then went to the DLQ as `run_not_found`, the resume lost."""
    cancelled = await put_run(env.store, status=RunStatus.CANCELLED)
    await env.blobs.put_bytes(f"runs/{cancelled.run_id}/attachments/doc", b"x")
    await _clock_past(cancelled.updated_at)
    plan = await ops.plan_gc(env, timedelta(0))
    assert plan.run_ids == (cancelled.run_id,)
    resumed = await env.store.update_run(
        cancelled.run_id,
        [Eq("status", RunStatus.CANCELLED)],
        Update(set={"status": RunStatus.QUEUED, "attempt": 2}),
    )
    assert not isinstance(resumed, CasConflict)

    report = await ops.collect_garbage(env, plan)

    assert report.runs == 0
    assert (await env.store.get_run(cancelled.run_id)).status is RunStatus.QUEUED
    assert await env.blobs.get_bytes(f"runs/{cancelled.run_id}/attachments/doc") == b"x"


async def test_gc_keeps_an_old_dlq_record_whose_run_still_waits_on_it(
    env: Env, dlq: DlqStore
) -> None:
    """Found by an operator walkthrough: `gc --older-than 30s` deleted the records of runs
    still parked `failed_resumable DLQ_PARKED`, whose way back (`dlq replay ID`, named by their
    `run_dlq_parked` event) then pointed at nothing. Kept; a settled or gone run's record
    goes, and so does the record of a run this gc deletes."""
    parked = await put_run(env.store, status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED")
    settled = await put_run(env.store, status=RunStatus.FINISHED)
    for seq, run in ((71, parked), (72, settled)):
        await dlq.put(seq=seq, body=b"x", headers={}, reason="retries_exhausted", run_id=run.run_id)
    gone = await dlq.put(seq=73, body=b"x", headers={}, reason="run_not_found", run_id="nope")
    await _clock_past(gone.at)

    plan = await ops.plan_gc(env, timedelta(0))
    report = await ops.collect_garbage(env, plan)

    assert (sorted(plan.dlq_ids), plan.dlq_kept) == ([72, 73], 1)
    assert (report.runs, report.dlq_records, report.dlq_kept) == (1, 2, 1)
    assert (await dlq.get(71)).run_id == parked.run_id
    for seq in (72, 73):
        with pytest.raises(RecordNotFound):
            await dlq.get(seq)


async def test_collect_garbage_with_nats_unreachable_still_collects_runs_and_says_why(
    env: Env,
) -> None:
    old = await put_run(env.store, status=RunStatus.CANCELLED)
    await _clock_past(old.updated_at)
    unreachable = Env(
        env.settings,
        env.engine,
        env.store,
        env.blobs,
        env.client,
        env.wire().model_copy(update={"nats_url": "nats://127.0.0.1:1"}),
    )

    plan = await ops.plan_gc(unreachable, timedelta(0))
    report = await ops.collect_garbage(unreachable, plan)

    assert report.runs == 1
    assert isinstance(report.dlq_error, NatsUnavailable)
    with pytest.raises(RunNotFound):
        await env.store.get_run(old.run_id)
