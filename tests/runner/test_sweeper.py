"""The orphan sweeper (SPEC §5.9), one pass at a time through `Sweeper.sweep_once`, on runners
that do not consume (so every message the sweeper publishes stays where a test can read it).
Here the grace is 3 s and the lease interval 1 s."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from engine.local import new_run_id
from engine.sandbox.local import LocalSandboxDriver
from engine.sandbox.protocols import SandboxSpec
from publisher.wire import HDR_MSG_ID
from runner.sweeper import Sweeper
from store import CasConflict, Eq, Origin, Publication, RunDocument, RunStatus, Update, utcnow
from tests.runner.callables import body, bound_drain, idle_runner, lease, new_run, publish_raw
from tests.runner.conftest import Fleet

S = RunStatus
LONG_AGO = timedelta(seconds=10)  # past the 3 s grace


@pytest.fixture(autouse=True)
async def _quick_drain(fleet: Fleet) -> AsyncIterator[None]:
    yield
    bound_drain(fleet.runners)


@pytest.fixture
async def sweeper(fleet: Fleet) -> Sweeper:
    runner = await idle_runner(fleet, owner="sweeper-a")
    return Sweeper(runner.svc)


async def create(fleet: Fleet, status: RunStatus, **fields: Any) -> RunDocument:
    fields.setdefault("attempt_at", utcnow() - LONG_AGO)
    doc = new_run("hello", run_id=new_run_id(), status=status, **fields)
    await fleet.store.create_run(doc)
    return await fleet.store.get_run(doc.run_id)


async def message_id(fleet: Fleet, seq: int) -> str:
    msg = await fleet.js.get_msg(fleet.names.runs_stream, seq)
    return str(dict(msg.headers or {})[HDR_MSG_ID])


async def gone_copy(fleet: Fleet, run_id: str, attempt: int = 1) -> int:
    """A copy that was published and is gone now (acked, or deleted)."""
    ack = await publish_raw(
        fleet.js, fleet.names.runs_subject, body(run_id, attempt), run_id=run_id, attempt=attempt
    )
    await fleet.js.delete_msg(fleet.names.runs_stream, ack.seq)
    return int(ack.seq)


def publication(seq: int, attempt: int = 1, age: timedelta = LONG_AGO) -> Publication:
    return Publication(attempt=attempt, stream_seq=seq, at=utcnow() - age)


async def present(fleet: Fleet, seq: int) -> bool:
    try:
        await fleet.js.get_msg(fleet.names.runs_stream, seq)
    except NotFoundError:
        return False
    return True


# -- queued (or auto-resumable) with no copy on the queue -----------------------------------------


async def test_sweeper_republishes_an_unpublished_queued_run_after_the_grace_with_its_original_id(
    fleet: Fleet, sweeper: Sweeper
) -> None:
    orphan = await create(fleet, S.QUEUED)
    young = await create(fleet, S.QUEUED, attempt_at=utcnow())  # its publish may be in flight
    report = await sweeper.sweep_once(force=True)
    assert report.swept
    assert dict(report.actions) == {"republish_missing": 1}
    doc = await fleet.store.get_run(orphan.run_id)
    assert doc.publication is not None and doc.publication.attempt == 1
    assert doc.publication.stream_seq is not None
    assert await message_id(fleet, doc.publication.stream_seq) == f"{orphan.run_id}:1"
    assert doc.version == orphan.version  # a publication write bumps no version
    assert (await fleet.store.get_run(young.run_id)).publication is None
    assert await fleet.stream_messages() == 1


async def test_sweeper_republish_answered_duplicate_records_the_originals_sequence(
    fleet: Fleet, sweeper: Sweeper
) -> None:
    run = await create(fleet, S.QUEUED)
    # The original landed, but its publisher died before recording it.
    original = await publish_raw(
        fleet.js, fleet.names.runs_subject, body(run.run_id, 1), run_id=run.run_id, attempt=1
    )
    report = await sweeper.sweep_once(force=True)
    assert dict(report.actions) == {"republish_duplicate": 1}
    doc = await fleet.store.get_run(run.run_id)
    assert doc.publication is not None
    assert doc.publication.stream_seq == original.seq
    assert await fleet.stream_messages() == 1


async def test_sweeper_republishes_a_publication_whose_message_is_gone_as_s_n(
    fleet: Fleet, sweeper: Sweeper
) -> None:
    run = await create(fleet, S.QUEUED)
    seq = await gone_copy(fleet, run.run_id)
    pinned = await fleet.store.update_run(
        run.run_id,
        [Eq("attempt", 1)],
        Update(set={"publication": publication(seq).model_dump()}, bump_version=False),
    )
    assert not isinstance(pinned, CasConflict)
    report = await sweeper.sweep_once(force=True)
    assert dict(report.actions) == {"republish_gone": 1}
    doc = await fleet.store.get_run(run.run_id)
    assert doc.sweep_republishes == 1
    assert doc.publication is not None and doc.publication.stream_seq not in (None, seq)
    assert doc.publication.msg_id == f"{run.run_id}:1:s1"
    assert doc.publication.stream_seq is not None
    assert await message_id(fleet, doc.publication.stream_seq) == f"{run.run_id}:1:s1"
    assert [(e.type, e.data) for e in await fleet.store.read_events(run.run_id)] == [
        ("run_queued", {"attempt": 1, "kind": "sweep"})
    ]
    # That copy goes too (say its delivery was acked by a runner that then died): n counts on.
    await fleet.js.delete_msg(fleet.names.runs_stream, doc.publication.stream_seq)
    aged = await fleet.store.update_run(
        run.run_id,
        [Eq("attempt", 1)],
        Update(set={"publication.at": utcnow() - LONG_AGO}, bump_version=False),
    )
    assert not isinstance(aged, CasConflict)
    report = await sweeper.sweep_once(force=True)
    assert dict(report.actions) == {"republish_gone": 1}
    doc = await fleet.store.get_run(run.run_id)
    assert doc.sweep_republishes == 2
    assert doc.publication is not None and doc.publication.msg_id == f"{run.run_id}:1:s2"


async def test_sweeper_leaves_a_copy_that_is_still_on_the_queue_or_too_young(
    fleet: Fleet, sweeper: Sweeper
) -> None:
    waiting = await create(fleet, S.FAILED_RESUMABLE, failure_code="SANDBOX_CAPACITY")
    ack = await publish_raw(
        fleet.js,
        fleet.names.runs_subject,
        body(waiting.run_id, 1),
        run_id=waiting.run_id,
        attempt=1,
    )
    young = await create(fleet, S.QUEUED)
    young_seq = await gone_copy(fleet, young.run_id)
    for run, pub in [
        (waiting, publication(ack.seq)),  # nak'd, waiting out its delay
        (young, publication(young_seq, age=timedelta(0))),  # within one lease interval
    ]:
        await fleet.store.update_run(
            run.run_id, [], Update(set={"publication": pub.model_dump()}, bump_version=False)
        )
    parked = await create(fleet, S.FAILED_RESUMABLE, failure_code="DLQ_PARKED")
    report = await sweeper.sweep_once(force=True)
    assert dict(report.actions) == {}
    assert await fleet.stream_messages() == 1
    assert (await fleet.store.get_run(parked.run_id)).publication is None


class Reads:
    """The real store and stream, counting what a pass reads: documents and `get_msg`s."""

    def __init__(self, store: Any, js: Any) -> None:
        self.store, self.js = store, js
        self.docs: list[str] = []
        self.get_msgs: list[int] = []

    async def get_run(self, run_id: str) -> RunDocument:
        self.docs.append(run_id)
        return await self.store.get_run(run_id)  # type: ignore[no-any-return]

    async def get_msg(self, stream: str, seq: int | None = None, **kw: Any) -> Any:
        assert seq is not None
        self.get_msgs.append(seq)
        return await self.js.get_msg(stream, seq, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store if hasattr(self.store, name) else self.js, name)


async def test_sweeper_pass_reads_no_document_and_no_message_of_runs_whose_copy_is_on_the_queue(
    fleet: Fleet, sweeper: Sweeper
) -> None:
    """Issue 19: a pass costs what it may act on. 30 queued runs whose copies are on the
    queue, long published, and one whose copy is gone: one stream-info look, one document
    read (the gone one's) and no `get_msg`."""
    on_queue = []
    for _ in range(30):
        run = await create(fleet, S.QUEUED)
        ack = await publish_raw(
            fleet.js, fleet.names.runs_subject, body(run.run_id, 1), run_id=run.run_id, attempt=1
        )
        on_queue.append((run, ack.seq))
    gone = await create(fleet, S.QUEUED)
    gone_seq = await gone_copy(fleet, gone.run_id)
    for run, seq in [*on_queue, (gone, gone_seq)]:
        await fleet.store.update_run(
            run.run_id,
            [],
            Update(set={"publication": publication(seq).model_dump()}, bump_version=False),
        )
    import dataclasses

    reads = Reads(fleet.store, fleet.js)
    counted = Sweeper(dataclasses.replace(sweeper.svc, store=reads, js=reads))
    report = await counted.sweep_once(force=True)
    assert dict(report.actions) == {"republish_gone": 1}
    assert reads.docs.count(gone.run_id) >= 1
    assert set(reads.docs) == {gone.run_id}
    assert reads.get_msgs == []
    assert await fleet.stream_messages() == 31  # the 30 untouched, and the gone one's new copy


# -- running, its runner gone ---------------------------------------------------------------------


async def test_sweeper_marks_a_running_run_with_a_free_lease_and_no_message_runner_lost(
    fleet: Fleet, sweeper: Sweeper
) -> None:
    lost = await create(fleet, S.RUNNING, lease=lease(1, ttl=-5))
    seq = await gone_copy(fleet, lost.run_id)
    await fleet.store.update_run(
        lost.run_id, [], Update(set={"publication": publication(seq).model_dump()})
    )
    alive = await create(fleet, S.RUNNING, lease=lease(1, ttl=3))
    redelivering = await create(fleet, S.RUNNING, lease=lease(1, ttl=-5))
    on_queue = await publish_raw(
        fleet.js,
        fleet.names.runs_subject,
        body(redelivering.run_id, 1),
        run_id=redelivering.run_id,
        attempt=1,
    )
    await fleet.store.update_run(
        redelivering.run_id, [], Update(set={"publication": publication(on_queue.seq).model_dump()})
    )
    before = {r.run_id: await fleet.store.get_run(r.run_id) for r in (alive, redelivering)}

    report = await sweeper.sweep_once(force=True)
    assert dict(report.actions) == {"runner_lost": 1}
    doc = await fleet.store.get_run(lost.run_id)
    assert (doc.status, doc.failure_code, doc.lease) == (S.FAILED_RESUMABLE, "RUNNER_LOST", None)
    assert doc.publication is not None and doc.publication.msg_id == f"{lost.run_id}:1:s1"
    assert doc.publication.stream_seq is not None
    assert await present(fleet, doc.publication.stream_seq)
    assert [e.type for e in await fleet.store.read_events(lost.run_id)] == [
        "run_failed",
        "run_queued",
    ]
    for run_id, doc_before in before.items():
        assert await fleet.store.get_run(run_id) == doc_before


async def test_sweeper_never_republishes_local_runs(fleet: Fleet, sweeper: Sweeper) -> None:
    local = [
        await create(fleet, S.QUEUED, origin=Origin.LOCAL),
        await create(fleet, S.RUNNING, origin=Origin.LOCAL, lease=lease(1, ttl=-5)),
        await create(fleet, S.FAILED_RESUMABLE, origin=Origin.LOCAL, failure_code="RUNNER_LOST"),
    ]
    report = await sweeper.sweep_once(force=True)
    assert dict(report.actions) == {}
    for run in local:
        assert await fleet.store.get_run(run.run_id) == run
    assert await fleet.queue_drained()


# -- one pass at a time ---------------------------------------------------------------------------


async def test_only_one_sweeper_pass_at_a_time_across_two_runners(
    fleet: Fleet, sweeper: Sweeper
) -> None:
    other = Sweeper((await idle_runner(fleet, owner="sweeper-b")).svc)
    orphan = await create(fleet, S.QUEUED)
    first = await sweeper.sweep_once()
    second = await other.sweep_once()
    assert first.swept and dict(first.actions) == {"republish_missing": 1}
    assert not second.swept and dict(second.actions) == {}
    assert (await sweeper.sweep_once()).swept  # the holder renews its pass
    assert not (await other.sweep_once()).swept
    assert (await fleet.store.get_run(orphan.run_id)).publication is not None
    assert await fleet.stream_messages() == 1


# -- orphan sandboxes -----------------------------------------------------------------------------


async def test_sweeper_reaps_sandboxes_whose_run_lease_is_no_longer_theirs(
    fleet: Fleet, sweeper: Sweeper, tmp_path: Path
) -> None:
    # A lease far from expiry: the pass must not also judge the run RUNNER_LOST (and drop the
    # lease) on a slow machine before it reaps.
    run = await create(fleet, S.RUNNING, lease=lease(2, ttl=120), attempt=2)
    assert run.lease is not None
    driver = LocalSandboxDriver(fleet.tmp / "data")

    def spec(run_id: str, token: str) -> SandboxSpec:
        return SandboxSpec(
            run_id=run_id,
            lease_token=token,
            workspace_dir=tmp_path / "ws" / run_id / token,
            scratch_dir=tmp_path / "scratch" / run_id,
        )

    live = await driver.start(spec(run.run_id, run.lease.token))
    stale = await driver.start(spec(run.run_id, "earlier-execution"))
    unknown = await driver.start(spec(new_run_id(), "of-a-deleted-run"))
    try:
        report = await sweeper.sweep_once(force=True)
        assert report.actions["sandbox_reaped"] == 2
        refs = await driver.list_sandboxes()
        assert [(r.run_id, r.token) for r in refs] == [(run.run_id, run.lease.token)]
    finally:
        for box in (live, stale, unknown):
            await box.stop()
