"""The sweeper's edges (issue 12 item 6 and item 1, SPEC §5.9): every action's CAS carries the
status, attempt and `publication` read and lease free — the counter CAS too —, the missing-
publication branch CASes before it publishes, the election lock is kept through a long pass,
and a run whose last delivery was dead-lettered is parked, never republished."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import pytest

from publisher.wire import HDR_MSG_ID
from runner.services import RunnerServices
from runner.sweeper import LOCK, Sweeper
from store import Eq, RunDocument, RunStatus, RunStore, Update, utcnow
from tests.runner.callables import body, bound_drain, idle_runner, lease, publish_raw
from tests.runner.conftest import Fleet
from tests.runner.test_sweeper import create, gone_copy, present, publication

S = RunStatus


@pytest.fixture(autouse=True)
async def _quick_drain(fleet: Fleet) -> AsyncIterator[None]:
    yield
    bound_drain(fleet.runners)


@pytest.fixture
async def svc(fleet: Fleet) -> RunnerServices:
    runner = await idle_runner(fleet, owner="sweeper-hardening")
    services: RunnerServices = runner.svc
    return services


class RivalAfter:
    """The real store; `rival` runs once, right after the sweeper's first call of `method`, so
    what the sweeper goes on to judge has since changed."""

    def __init__(
        self, inner: RunStore, method: str, rival: Callable[[], Awaitable[object]]
    ) -> None:
        self.inner = inner
        self.method = method
        self.rival: Callable[[], Awaitable[object]] | None = rival

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        async def then_rival(*args: Any, **kwargs: Any) -> Any:
            result = await attr(*args, **kwargs)
            if self.rival is not None:
                rival, self.rival = self.rival, None
                await rival()
            return result

        return then_rival


def sweeper_on(svc: RunnerServices, **parts: Any) -> Sweeper:
    import dataclasses

    return Sweeper(dataclasses.replace(svc, **parts))


async def pin_publication(fleet: Fleet, run_id: str, seq: int) -> RunDocument:
    doc = await fleet.store.update_run(
        run_id, [], Update(set={"publication": publication(seq).model_dump()}, bump_version=False)
    )
    assert isinstance(doc, RunDocument)
    return doc


# -- every CAS carries what it read ---------------------------------------------------------------


@pytest.mark.parametrize("rival", ["late_publication_record", "lease_taken"])
async def test_sweeper_counter_cas_carries_the_publication_and_lease_free_it_read(
    fleet: Fleet, svc: RunnerServices, rival: str
) -> None:
    run = await create(fleet, S.QUEUED)
    await pin_publication(fleet, run.run_id, await gone_copy(fleet, run.run_id))
    landed = await publish_raw(
        fleet.js,
        fleet.names.runs_subject,
        body(run.run_id, 1),
        id_=f"{run.run_id}:1:late",
    )

    async def change() -> object:
        if rival == "late_publication_record":
            # The copy that carries the run was recorded meanwhile (a bump-free write).
            return await pin_publication(fleet, run.run_id, int(landed.seq))
        # An execution took the lease meanwhile (status, attempt, publication unchanged).
        await fleet.js.delete_msg(fleet.names.runs_stream, landed.seq)
        return await fleet.store.update_run(
            run.run_id,
            [],
            Update(set={"lease": lease(1, ttl=30).model_dump()}, bump_version=False),
        )

    sweeper = sweeper_on(svc, store=RivalAfter(fleet.store, "get_run", change))
    report = await sweeper.sweep_once(force=True)
    assert dict(report.actions) == {}
    doc = await fleet.store.get_run(run.run_id)
    assert doc.sweep_republishes == 0
    expected = 1 if rival == "late_publication_record" else 0
    assert await fleet.stream_messages() == expected  # nothing republished


async def test_sweeper_missing_publication_branch_cases_before_it_publishes(
    fleet: Fleet, svc: RunnerServices
) -> None:
    # Never published (its publisher died first): the sweeper would republish it...
    run = await create(fleet, S.QUEUED)

    async def operator_cancel() -> object:
        # ...but an operator cancels it between the sweeper's read and its publish.
        return await fleet.store.update_run(
            run.run_id,
            [Eq("status", S.QUEUED), Eq("attempt", 1)],
            Update(set={"status": S.CANCELLED}),
        )

    sweeper = sweeper_on(svc, store=RivalAfter(fleet.store, "get_run", operator_cancel))
    report = await sweeper.sweep_once(force=True)
    assert dict(report.actions) == {}
    assert await fleet.stream_messages() == 0  # no copy of a cancelled run on the queue
    doc = await fleet.store.get_run(run.run_id)
    assert (doc.status, doc.publication) == (S.CANCELLED, None)


async def test_sweeper_passes_over_a_run_that_left_the_swept_statuses_after_its_row_was_read(
    fleet: Fleet, svc: RunnerServices
) -> None:
    """Found by the protocol model: the row says `queued`, the document read next says
    `cancelled` (an operator acted in between). Every sweeper CAS is on what it read, so only
    the status check stops it republishing a cancelled run."""
    run = await create(fleet, S.QUEUED)  # never published, past the grace

    async def operator_cancel() -> object:
        return await fleet.store.update_run(
            run.run_id,
            [Eq("status", S.QUEUED), Eq("attempt", 1)],
            Update(set={"status": S.CANCELLED}),
        )

    sweeper = sweeper_on(svc, store=RivalAfter(fleet.store, "list_run_copies", operator_cancel))
    report = await sweeper.sweep_once(force=True)
    assert dict(report.actions) == {}
    assert await fleet.stream_messages() == 0
    doc = await fleet.store.get_run(run.run_id)
    assert (doc.status, doc.publication, doc.sweep_republishes) == (S.CANCELLED, None, 0)


async def test_two_sweepers_racing_on_a_missing_publication_publish_it_once(
    fleet: Fleet, svc: RunnerServices
) -> None:
    run = await create(fleet, S.QUEUED)
    first = Sweeper(svc)
    stale = await fleet.store.get_run(run.run_id)
    assert (await first.sweep_once(force=True)).actions == {"republish_missing": 1}
    # A second pass that read the run before the first recorded anything acts on that read.
    assert await sweeper_on(svc)._judge(stale) is None
    assert await fleet.stream_messages() == 1


# -- the lock is kept through the pass ------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> datetime:
        return self.now


class SlowSweeper(Sweeper):
    """Each judgement takes `step` of (fake) time; meanwhile another runner tries to take the
    sweeper lock, as its own loop would."""

    def __init__(self, svc: RunnerServices, clock: FakeClock, step: timedelta) -> None:
        super().__init__(svc, clock=clock)
        self.clock = clock
        self.step = step
        self.rival_won: list[bool] = []

    async def _judge(self, run: RunDocument) -> str | None:
        self.clock.now += self.step
        won = await self.svc.store.try_lock(LOCK, "sweeper-b", self.clock.now, 2.0)
        self.rival_won.append(won)
        return await super()._judge(run)


async def test_sweeper_lock_is_renewed_so_a_long_pass_never_overlaps_another(
    fleet: Fleet, svc: RunnerServices
) -> None:
    orphans = [await create(fleet, S.QUEUED) for _ in range(8)]
    ttl = svc.wire.sweeper_interval * 2
    sweeper = SlowSweeper(svc, FakeClock(), step=ttl * 0.4)  # the pass lasts 3.2 TTLs
    report = await sweeper.sweep_once()
    assert report.swept and not report.cut_short
    assert sweeper.rival_won == [False] * len(orphans)
    assert dict(report.actions) == {"republish_missing": len(orphans)}


async def test_sweeper_pass_stops_when_its_lock_lapsed(fleet: Fleet, svc: RunnerServices) -> None:
    for _ in range(3):
        await create(fleet, S.QUEUED)
    ttl = svc.wire.sweeper_interval * 2
    sweeper = SlowSweeper(svc, FakeClock(), step=ttl * 1.1)  # one step outlives the lock
    report = await sweeper.sweep_once()
    assert report.swept and report.cut_short
    # The first judgement ran under the lock; the rival took the lapsed lock meanwhile, and
    # this pass judged nothing more.
    assert sweeper.rival_won == [True]
    assert dict(report.actions) == {"republish_missing": 1}


# -- a dead-lettered copy is never republished ----------------------------------------------------


@pytest.mark.parametrize(
    ("status", "fields", "cause"),
    [
        (S.QUEUED, {}, None),
        (S.FAILED_RESUMABLE, {"failure_code": "SANDBOX_LOST"}, "SANDBOX_LOST"),
        (S.RUNNING, {"lease": lease(1, ttl=-5)}, None),
    ],
    ids=["queued", "auto_resumable", "running_lease_free"],
)
async def test_sweeper_never_republishes_a_run_whose_last_delivery_was_dead_lettered(
    fleet: Fleet, svc: RunnerServices, status: RunStatus, fields: dict[str, Any], cause: str | None
) -> None:
    run = await create(fleet, status, **fields)
    seq = await gone_copy(fleet, run.run_id)  # recorded, then acked: the message is gone
    await pin_publication(fleet, run.run_id, seq)
    await fleet.dlq.put(
        seq=seq,
        body=body(run.run_id, 1),
        headers={},
        reason="internal_error",
        run_id=run.run_id,
        attempt=1,
    )
    report = await Sweeper(svc).sweep_once(force=True)
    assert dict(report.actions) == {"dlq_parked": 1}
    doc = await fleet.store.get_run(run.run_id)
    assert (doc.status, doc.failure_code, doc.cause_code, doc.lease) == (
        S.FAILED_RESUMABLE,
        "DLQ_PARKED",
        cause,
        None,
    )
    assert (doc.attempt, doc.sweep_republishes) == (1, 0)
    assert [(e.type, e.data) for e in await fleet.store.read_events(run.run_id)] == [
        ("run_dlq_parked", {"reason": "internal_error", "record_id": seq})
    ]
    assert await fleet.stream_messages() == 0
    assert (await fleet.dlq.get(seq)).run_id == run.run_id  # the record stays, for a replay
    # The next pass leaves it alone: DLQ_PARKED is not auto-resumable.
    assert dict((await Sweeper(svc).sweep_once(force=True)).actions) == {}


async def test_sweeper_parks_only_for_a_record_of_the_runs_current_attempt(
    fleet: Fleet, svc: RunnerServices
) -> None:
    run = await create(fleet, S.QUEUED, attempt=2)
    seq = await gone_copy(fleet, run.run_id, attempt=2)
    await fleet.store.update_run(
        run.run_id,
        [],
        Update(set={"publication": publication(seq, attempt=2).model_dump()}, bump_version=False),
    )
    await fleet.dlq.put(
        seq=seq, body=b"", headers={}, reason="internal_error", run_id=run.run_id, attempt=1
    )
    report = await Sweeper(svc).sweep_once(force=True)
    assert dict(report.actions) == {"republish_gone": 1}
    doc = await fleet.store.get_run(run.run_id)
    assert doc.publication is not None and doc.publication.stream_seq is not None
    assert await present(fleet, doc.publication.stream_seq)
    msg = await fleet.js.get_msg(fleet.names.runs_stream, doc.publication.stream_seq)
    assert dict(msg.headers or {})[HDR_MSG_ID] == f"{run.run_id}:2:s1"


# -- one bad document, and the runs parked for a person (found by review) -------------------------


def _corrupt(fleet: Fleet, run_id: str, path: str, value_sql: str) -> None:
    """Rewrite one field of the stored document behind the store's back (SQLite)."""
    import sqlite3

    conn = sqlite3.connect(fleet.tmp / "runs.db")
    try:
        conn.execute(
            f"UPDATE runs SET doc = json_set(doc, '{path}', {value_sql}) WHERE run_id = ?",
            (run_id,),
        )
        conn.commit()
    finally:
        conn.close()
    fleet.store.remembered.forget(run_id)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("path", "value_sql"), [("$.tenant", "''"), ("$.attempt", "json('null')")])
async def test_sweeper_an_unreadable_run_does_not_stop_the_pass_for_the_runs_after_it(
    fleet: Fleet, svc: RunnerServices, path: str, value_sql: str
) -> None:
    """A document that does not validate (or whose attempt is not a number) stopped every pass
    at itself, so every run after it in id order was never swept: here an unpublished
    `queued` run, stranded."""
    ago = utcnow() - timedelta(seconds=10)
    bad = await create(fleet, status=S.QUEUED, attempt_at=ago)
    stranded = await create(fleet, status=S.QUEUED, attempt_at=ago)
    assert bad.run_id < stranded.run_id
    _corrupt(fleet, bad.run_id, path, value_sql)

    report = await Sweeper(svc).sweep_once(force=True)

    assert report.actions["unreadable"] == 1
    assert (await fleet.store.get_run(stranded.run_id)).publication is not None


async def test_sweeper_passes_over_runs_parked_for_a_person_without_reading_them(
    fleet: Fleet, svc: RunnerServices
) -> None:
    """`failed_resumable` with a code only a person resumes: no rule of §5.9 acts on it, and
    each pass used to read every one of them in full."""
    ago = utcnow() - timedelta(seconds=10)
    parked = [
        await create(fleet, status=S.FAILED_RESUMABLE, failure_code="DLQ_PARKED", attempt_at=ago)
        for _ in range(5)
    ]
    store = CountingReads(fleet.store)
    report = await sweeper_on(svc, store=store).sweep_once(force=True)

    assert not report.actions
    assert not set(store.reads) & {p.run_id for p in parked}
    again = await create(fleet, status=S.FAILED_RESUMABLE, failure_code="RUNNER_LOST")
    await sweeper_on(svc, store=store).sweep_once(force=True)
    assert again.run_id in store.reads  # an auto-resumable one is still judged


class CountingReads:
    """The real store, recording the runs it was asked to read in full."""

    def __init__(self, inner: RunStore) -> None:
        self.inner = inner
        self.reads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get_run(self, run_id: str) -> RunDocument:
        self.reads.append(run_id)
        return await self.inner.get_run(run_id)
