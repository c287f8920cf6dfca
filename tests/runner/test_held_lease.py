"""Protocol hardening under a held lease (SPEC v2.2 §5.1, §5.3, §5.6, §5.8; issue 12 items 1, 5
and 7), on a live runner with a real nats-server and SQLite.

Each fault is injected at one seam of the real parts (a store or driver that raises at one
call) and every test asserts what the run, the stream and the DLQ hold afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from engine.sandbox.protocols import Sandbox, SandboxSpec
from publisher.errors import PublishFailed, RecordNotFound
from runner.runner import Runner
from runner.sweeper import Sweeper
from store import (
    CasConflict,
    Condition,
    DocumentInvalid,
    Eq,
    RunDocument,
    RunStatus,
    StoreUnavailable,
    Update,
)
from store.sqlite import SqliteRunStore
from tests.runner.callables import bound_drain, open_fleet, workflow
from tests.runner.conftest import Fleet, deliveries, eventually, reaches
from tests.support.nats_server import NatsServer

S = RunStatus


@pytest.fixture
async def small_fleet(tmp_path: Path, nats_server: NatsServer) -> AsyncIterator[Fleet]:
    """A fleet whose consumer delivers each message at most twice."""
    async with open_fleet(tmp_path / "small", nats_server, max_deliver=2) as fleet:
        yield fleet
        bound_drain(fleet.runners)


@pytest.fixture(autouse=True)
async def _quick_drain(fleet: Fleet) -> AsyncIterator[None]:
    yield
    bound_drain(fleet.runners)


async def has_record(fleet: Fleet, seq: int) -> bool:
    try:
        await fleet.dlq.get(seq)
    except RecordNotFound:
        return False
    return True


async def events_of(fleet: Fleet, run_id: str, type_: str) -> list[Any]:
    return [e for e in await fleet.store.read_events(run_id) if e.type == type_]


class Seam:
    """The real SQLite store, with one write or append that misbehaves when `when` says so."""

    def __init__(self, inner: SqliteRunStore) -> None:
        self.inner = inner
        self.on_update: Callable[[str, Update], Exception | None] = lambda _r, _u: None
        self.after_update: Callable[[str, Update, RunDocument | CasConflict], Any] | None = None
        self.on_append: Callable[[str], Exception | None] = lambda _t: None
        self.on_get: Callable[[str], Exception | None] = lambda _r: None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get_run(self, run_id: str, *args: Any, **kwargs: Any) -> RunDocument:
        error = self.on_get(run_id)
        if error is not None:
            raise error
        return await self.inner.get_run(run_id, *args, **kwargs)

    async def update_run(
        self, run_id: str, conditions: list[Condition], update: Update, **kw: Any
    ) -> RunDocument | CasConflict:
        error = self.on_update(run_id, update)
        for draft in kw.get("events", ()):  # events that ride with the write (issue 19)
            error = error or self.on_append(draft.type)
        if error is not None:
            raise error
        result = await self.inner.update_run(run_id, conditions, update, **kw)
        if self.after_update is not None:
            await self.after_update(run_id, update, result)
        return result

    async def append_event(self, run_id: str, type: str, *args: Any, **kwargs: Any) -> Any:
        error = self.on_append(type)
        if error is not None:
            raise error
        return await self.inner.append_event(run_id, type, *args, **kwargs)


async def start_on(fleet: Fleet, store: Any, **settings: Any) -> Runner:
    inner = fleet.store
    fleet.store = store
    try:
        return await fleet.start_runner(**{"sweeper": False, "backstop": False, **settings})
    finally:
        fleet.store = inner


def is_claim(update: Update) -> bool:
    return update.set.get("status") == S.RUNNING and "lease" in update.set


# -- 1. any error under a held lease parks the run once ------------------------------------------


async def test_held_lease_any_error_parks_the_run_once_when_its_workflow_no_longer_loads(
    small_fleet: Fleet,
) -> None:
    """A stored workflow that no longer loads raises while the execution is built, after the
    claim won: that is `INTERNAL_ERROR`, nak'd, then parked `DLQ_PARKED` at the last delivery
    with one record — never left `running` behind a record, never republished by the sweeper."""
    fleet = small_fleet
    run = await fleet.launch(workflow("hello").source)
    await fleet.store.update_run(
        run.run_id, [Eq("status", S.QUEUED)], Update(set={"workflow.source": "nodes: [broken"})
    )
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    parked = await eventually(
        lambda: _status_when(fleet, run.run_id, lambda d: d.failure_code == "DLQ_PARKED")
    )
    assert (parked.status, parked.cause_code) == (S.FAILED_RESUMABLE, "INTERNAL_ERROR")
    assert parked.lease is None
    seq = run.publication.stream_seq if run.publication else 0
    record = await fleet.dlq.get(seq)
    assert (record.reason, record.run_id) == ("retries_exhausted", run.run_id)
    scheduled = await events_of(fleet, run.run_id, "run_retry_scheduled")
    assert [e.data["code"] for e in scheduled] == ["INTERNAL_ERROR"]
    assert len(await events_of(fleet, run.run_id, "run_dlq_parked")) == 1
    assert deliveries(runner, "dlq", "internal_error") == 0
    # The sweeper leaves a DLQ_PARKED run alone: no republish, no new attempt.
    assert runner.svc is not None
    await Sweeper(runner.svc).sweep_once(force=True)
    after = await fleet.store.get_run(run.run_id)
    assert (after.status, after.attempt, after.failure_code) == (
        S.FAILED_RESUMABLE,
        1,
        "DLQ_PARKED",
    )


async def _status_when(
    fleet: Fleet, run_id: str, ok: Callable[[RunDocument], bool]
) -> RunDocument | None:
    doc = await fleet.store.get_run(run_id)
    return doc if ok(doc) and doc.lease is None else None


TWO_NODES = """\
name: two_nodes
entry: a
nodes:
  a: {kind: compute, set: {x: "1 + 1"}}
  b: {kind: compute, set: {y: "outputs.a.x * 2"}}
edges:
  - {from: a, to: b}
"""


async def test_held_lease_error_in_the_run_claimed_append_is_an_internal_error_outcome(
    fleet: Fleet,
) -> None:
    assert isinstance(fleet.store, SqliteRunStore)
    seam = Seam(fleet.store)
    failed: list[str] = []

    def once(type_: str) -> Exception | None:
        if type_ == "run_claimed" and not failed:
            failed.append(type_)
            return RuntimeError("the append blew up")
        return None

    seam.on_append = once
    await start_on(fleet, seam)
    # Two nodes: `run_claimed` rides with the first boundary's checkpoint, a write the engine
    # makes while the run is held (a one-node run's rides with its `finished` status write).
    run = await fleet.launch(TWO_NODES)
    done = await fleet.wait_status(run.run_id, "finished", within=20)
    assert done.attempt == 1
    scheduled = await events_of(fleet, run.run_id, "run_retry_scheduled")
    assert [e.data["code"] for e in scheduled] == ["INTERNAL_ERROR"]
    claims = await events_of(fleet, run.run_id, "run_claimed")
    # The write that carried `run_claimed` raised, so the narration was given back and rode
    # with the next write, the INTERNAL_ERROR status: the fresh claim is on record, then the
    # auto-retry's (issue 19: events ride with the state writes).
    assert [e.data["path"] for e in claims] == ["fresh", "auto_retry"]


class StopOthersFails:
    """The real local driver, whose `stop_others` raises once."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.raised = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def stop_others(self, run_id: str, keep_token: str) -> list[str]:
        if not self.raised:
            self.raised += 1
            raise OSError("cannot list the sandboxes")
        result: list[str] = await self.inner.stop_others(run_id, keep_token)
        return result


async def test_held_lease_error_in_stop_others_is_an_internal_error_outcome(fleet: Fleet) -> None:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    assert runner.svc is not None
    driver = StopOthersFails(runner.svc.driver)
    runner.svc.driver = driver  # type: ignore[assignment]
    run = await fleet.launch(workflow("hello").source)
    await fleet.wait_status(run.run_id, "finished", within=20)
    assert driver.raised == 1
    scheduled = await events_of(fleet, run.run_id, "run_retry_scheduled")
    assert [e.data["code"] for e in scheduled] == ["INTERNAL_ERROR"]


class StopRaises:
    """The real local driver; its sandboxes' `stop` raises after stopping for real."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.stops = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def start(self, spec: SandboxSpec) -> Sandbox:
        sandbox = await self.inner.start(spec)
        outer = self

        class Wrapped:
            def __getattr__(self, name: str) -> Any:
                return getattr(sandbox, name)

            async def stop(self) -> None:
                await sandbox.stop()
                outer.stops += 1
                raise OSError("stop failed")

        return Wrapped()  # type: ignore[return-value]


async def test_held_lease_sandbox_stop_raising_in_teardown_still_releases_and_disposes(
    fleet: Fleet,
) -> None:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    assert runner.svc is not None
    driver = StopRaises(runner.svc.driver)
    runner.svc.driver = driver  # type: ignore[assignment]
    run = await fleet.launch(workflow("tool").source)
    done = await fleet.wait_status(run.run_id, "finished", within=20)
    assert driver.stops == 1
    assert done.lease is None  # released although the stop raised
    assert await fleet.queue_drained()
    assert deliveries(runner, "ack", "finished") == 1


async def test_held_lease_store_unreachable_at_the_park_writes_no_dlq_record(
    small_fleet: Fleet, tmp_path: Path
) -> None:
    """At the last delivery the record is written first; when the park cannot be written
    (store down) the record is withdrawn and the delivery nak'd: no record stands while the
    run is still `running` (the lease expiry and the backstop own it)."""
    fleet = small_fleet
    assert isinstance(fleet.store, SqliteRunStore)
    seam = Seam(fleet.store)
    seam.on_update = lambda _r, u: (
        StoreUnavailable("down") if u.set.get("failure_code") == "DLQ_PARKED" else None
    )
    gates = tmp_path / "gates"
    gates.mkdir()
    runner = await start_on(fleet, seam)
    run = await fleet.launch(workflow("flaky").source, {"dir": str(gates)})
    await eventually(lambda: _at_least(runner, "nak", "store_unreachable"))
    seq = run.publication.stream_seq if run.publication else 0
    assert not await has_record(fleet, seq)
    doc = await fleet.store.get_run(run.run_id)
    assert doc.status is S.RUNNING


async def _at_least(runner: Runner, disposition: str, reason: str) -> bool:
    return deliveries(runner, disposition, reason) >= 1


async def test_last_delivery_transient_that_meets_a_pending_cancel_leaves_no_replayable_record(
    small_fleet: Fleet, tmp_path: Path
) -> None:
    """An operator's cancel lands just as the last delivery parks: the park write becomes
    `cancelled`, and the record written before it is withdrawn — a replay must never
    un-cancel the run."""
    fleet = small_fleet
    assert isinstance(fleet.store, SqliteRunStore)
    inner = fleet.store
    seam = Seam(inner)
    fired: list[bool] = []

    original = seam.update_run

    async def update_run(
        run_id: str, conditions: list[Condition], update: Update, **kw: Any
    ) -> RunDocument | CasConflict:
        if update.set.get("failure_code") == "DLQ_PARKED" and not fired:
            fired.append(True)
            await inner.update_run(run_id, [], Update(set={"cancel_requested": True}))
        return await original(run_id, conditions, update, **kw)

    seam.update_run = update_run  # type: ignore[method-assign]
    gates = tmp_path / "gates"
    gates.mkdir()
    await start_on(fleet, seam)
    run = await fleet.launch(workflow("flaky").source, {"dir": str(gates)})
    done = await fleet.wait_status(run.run_id, "cancelled", within=20)
    assert fired and done.cancel_requested is False
    seq = run.publication.stream_seq if run.publication else 0
    assert not await has_record(fleet, seq)
    assert await events_of(fleet, run.run_id, "run_cancelled")
    assert not await events_of(fleet, run.run_id, "run_dlq_parked")


# -- 5. the drain race -----------------------------------------------------------------------


async def test_claim_whose_cas_lands_after_the_drain_broadcast_is_handed_off_at_once(
    fleet: Fleet, tmp_path: Path
) -> None:
    assert isinstance(fleet.store, SqliteRunStore)
    seam = Seam(fleet.store)
    runners: list[Runner] = []

    async def drain_during_claim(run_id: str, update: Update, result: Any) -> None:
        if is_claim(update) and not isinstance(result, CasConflict) and runners:
            svc = runners[0].svc
            assert svc is not None
            if not svc.draining:
                svc.draining = True  # the broadcast lands while the claim's CAS is in flight

    seam.after_update = drain_during_claim
    gates = tmp_path / "gates"
    gates.mkdir()
    runners.append(await start_on(fleet, seam))
    run = await fleet.launch(workflow("hold").source, {"dir": str(gates)})
    handed = await eventually(lambda: _status_when(fleet, run.run_id, lambda d: d.attempt == 2))
    assert (handed.status, handed.failure_code) == (S.FAILED_RESUMABLE, "RUNNER_INTERRUPTED")
    # Nothing of attempt 1 ran: the claim was handed off before its first node.
    assert not (gates / f"{run.run_id}.entered").exists()
    started = [e for e in await events_of(fleet, run.run_id, "node_started") if e.attempt == 1]
    assert started == []
    queued = await events_of(fleet, run.run_id, "run_queued")
    assert [e.data["kind"] for e in queued][-1] == "handoff"
    # Another runner finishes it as attempt 2.
    await fleet.start_runner(sweeper=False, backstop=False)
    (gates / f"{run.run_id}.release").touch()
    done = await fleet.wait_status(run.run_id, "finished", within=30)
    # Attempt 2, unless the draining runner held its last delivery: then it was claimed and
    # handed off once more (§5.8) — either way attempt 1 ran nothing.
    assert done.attempt >= 2


async def test_draining_runner_hands_on_the_last_delivery_of_a_queued_run_instead_of_nacking_it(
    small_fleet: Fleet,
) -> None:
    """Delivery 1 is nak'd by a draining runner; delivery 2 is the last: it is handed on as
    attempt 2 (no delivery budget spent), never nak'd into the backstop's park."""
    fleet = small_fleet
    runner = await fleet.start_runner(sweeper=False, backstop=True)
    assert runner.svc is not None
    runner.svc.draining = True
    run = await fleet.launch(workflow("hello").source)
    handed = await eventually(lambda: _status_when(fleet, run.run_id, lambda d: d.attempt == 2))
    assert handed.status is S.QUEUED
    # The ack follows the hand-on's write: wait for it, then count exactly.
    await reaches(runner, "ack", "handed_on")
    assert deliveries(runner, "nak", "draining") >= 1  # delivery 1 (and attempt 2's copies)
    assert deliveries(runner, "ack", "handed_on") == 1
    seq = run.publication.stream_seq if run.publication else 0
    assert not await has_record(fleet, seq)
    queued = await events_of(fleet, run.run_id, "run_queued")
    assert [(e.attempt, e.data["kind"]) for e in queued] == [(1, "launch"), (2, "handoff")]
    runner.svc.draining = False
    done = await fleet.wait_status(run.run_id, "finished", within=20)
    assert (done.attempt, done.failure_code) == (2, None)


async def test_hand_on_carries_the_resume_request_so_its_answers_are_applied_once(
    small_fleet: Fleet,
) -> None:
    fleet = small_fleet
    source = (Path(__file__).parent.parent.parent / "examples" / "approval.yaml").read_text()
    worker = await fleet.start_runner(sweeper=False, backstop=False)
    run = await fleet.launch(source)
    await fleet.wait_status(run.run_id, "paused_waiting_human", within=20)
    assert worker.svc is not None
    worker.svc.draining = True
    from engine.resume import ResumeRequest

    await fleet.publisher.resume(
        run.run_id, ResumeRequest(answers={"approved": True, "note": "ok"}), tenant="default"
    )
    await eventually(lambda: _status_when(fleet, run.run_id, lambda d: d.attempt == 3))
    worker.svc.draining = False
    done = await fleet.wait_status(run.run_id, "finished", within=20)
    assert done.attempt == 3
    assert await events_of(fleet, run.run_id, "human_answers_recorded")
    assert len(await events_of(fleet, run.run_id, "human_input_requested")) == 1


# -- 7. order and honesty --------------------------------------------------------------------


class OrderProbe:
    """The real local driver; notes whether `run_claimed` of this execution already exists
    when `stop_others` is called."""

    def __init__(self, inner: Any, store: Any) -> None:
        self.inner = inner
        self.store = store
        self.claimed_before: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def stop_others(self, run_id: str, keep_token: str) -> list[str]:
        events = await self.store.read_events(run_id)
        mine = [e for e in events if e.type == "run_claimed" and e.execution == keep_token]
        self.claimed_before.append(bool(mine))
        result: list[str] = await self.inner.stop_others(run_id, keep_token)
        return result


async def test_stop_others_before_run_claimed(fleet: Fleet) -> None:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    assert runner.svc is not None
    probe = OrderProbe(runner.svc.driver, fleet.store)
    runner.svc.driver = probe  # type: ignore[assignment]
    run = await fleet.launch(workflow("hello").source)
    await fleet.wait_status(run.run_id, "finished", within=20)
    assert probe.claimed_before == [False]
    assert len(await events_of(fleet, run.run_id, "run_claimed")) == 1


async def test_store_error_from_the_claim_naks_with_the_transient_delay_and_writes_no_dlq_record(
    small_fleet: Fleet,
) -> None:
    fleet = small_fleet
    assert isinstance(fleet.store, SqliteRunStore)
    seam = Seam(fleet.store)
    seam.on_update = lambda _r, u: StoreUnavailable("down") if is_claim(u) else None
    runner = await start_on(fleet, seam)
    run = await fleet.launch(workflow("hello").source)
    await eventually(lambda: _naks(runner, "store_unreachable", 2))
    seq = run.publication.stream_seq if run.publication else 0
    assert not await has_record(fleet, seq)
    assert deliveries(runner, "dlq", "internal_error") == 0
    assert (await fleet.store.get_run(run.run_id)).status is S.QUEUED


async def test_a_run_whose_document_does_not_validate_is_dead_lettered_not_naked_forever(
    small_fleet: Fleet,
) -> None:
    """The store answered, with a document that does not validate: not an outage. It was naked
    as `store_unreachable` on every delivery and then by the backstop every 5 s, forever, with
    nothing recorded (an on-call walkthrough). Now: naked on the transient ladder, then a
    replayable `internal_error` record at the last delivery, which names the cause."""
    fleet = small_fleet
    assert isinstance(fleet.store, SqliteRunStore)
    seam = Seam(fleet.store)  # the runner's reads only: the launch writes through the store
    seam.on_get = lambda r: DocumentInvalid(f"stored run {r!r} fails validation at 'attempt'")
    runner = await start_on(fleet, seam)
    run = await fleet.launch(workflow("hello").source)
    seq = run.publication.stream_seq if run.publication else 0
    await eventually(lambda: has_record(fleet, seq))
    record = await fleet.dlq.get(seq)
    assert (record.reason, record.replayable) == ("internal_error", True)
    assert record.detail is not None and "does not validate" in record.detail
    assert deliveries(runner, "nak", "run_invalid") == 1  # max_deliver 2: one nak, then the record
    assert deliveries(runner, "nak", "store_unreachable") == 0


async def _naks(runner: Runner, reason: str, n: int) -> bool:
    return deliveries(runner, "nak", reason) >= n


async def test_store_error_from_cancel_stale_naks_with_the_transient_delay(fleet: Fleet) -> None:
    assert isinstance(fleet.store, SqliteRunStore)
    seam = Seam(fleet.store)
    failed: list[bool] = []

    def once(_r: str, u: Update) -> Exception | None:
        if u.set.get("status") == S.CANCELLED and not failed:
            failed.append(True)
            return StoreUnavailable("down")
        return None

    seam.on_update = once
    run = await fleet.launch(workflow("hello").source)
    await fleet.store.update_run(run.run_id, [], Update(set={"cancel_requested": True}))
    runner = await start_on(fleet, seam)
    await fleet.wait_status(run.run_id, "cancelled", within=20)
    assert deliveries(runner, "nak", "store_unreachable") == 1
    assert deliveries(runner, "nak", "internal_error") == 0


async def test_launch_failed_cas_lost_to_a_landed_copy_reports_the_running_run(
    fleet: Fleet, tmp_path: Path
) -> None:
    gates = tmp_path / "gates"
    gates.mkdir()
    await fleet.start_runner(sweeper=False, backstop=False)
    real_publish = fleet.publisher.publish

    async def publish(run: RunDocument, kind: Any, **kw: Any) -> Any:
        await real_publish(run, kind, **kw)

        async def claimed() -> RunDocument | None:
            doc = await fleet.store.get_run(run.run_id)
            return doc if doc.status is S.RUNNING else None

        await eventually(claimed)
        raise PublishFailed("the PubAck was lost")

    fleet.publisher.publish = publish  # type: ignore[method-assign]
    loaded = workflow("hold")
    doc = await fleet.publisher.launch(loaded, {"dir": str(gates)}, tenant="default")
    assert doc.status is S.RUNNING
    assert not await events_of(fleet, doc.run_id, "run_failed")
    (gates / f"{doc.run_id}.release").touch()
    done = await fleet.wait_status(doc.run_id, "finished", within=20)
    assert done.failure_code is None


async def test_lease_lost_while_the_status_write_was_refused_sends_no_disposition(
    fleet: Fleet,
) -> None:
    """The keeper gave up the lease during the outage that refused the status write: the
    execution is fenced, so it sends no nak (it would act on the adopter's delivery); the
    redelivery after `ack_wait` adopts the run and finishes it (SPEC §5.4)."""
    assert isinstance(fleet.store, SqliteRunStore)
    seam = Seam(fleet.store)
    runners: list[Runner] = []
    refused: list[str] = []

    def lose_then_refuse(run_id: str, update: Update) -> Exception | None:
        if update.set.get("status") == S.FINISHED and not refused:
            refused.append(run_id)
            svc = runners[0].svc
            assert svc is not None
            from engine.outcome import CancelReason

            svc.executions[run_id].cancel(CancelReason.LEASE_LOST)
            return StoreUnavailable("down")
        return None

    seam.on_update = lose_then_refuse
    runners.append(await start_on(fleet, seam))
    # Two nodes, so the first execution's `run_claimed` lands with its first boundary (a
    # one-node run's rides with the refused status write, and is refused with it).
    run = await fleet.launch(TWO_NODES)
    done = await fleet.wait_status(run.run_id, "finished", within=20)
    assert refused == [run.run_id] and done.failure_code is None
    assert deliveries(runners[0], "nak", "store_unreachable") == 0
    assert deliveries(runners[0], "none", "lease_lost") == 1
    claims = await events_of(fleet, run.run_id, "run_claimed")
    assert [e.data["path"] for e in claims] == ["fresh", "adoption"]


# -- a claim that lands past its lease's loss margin -----------------------------------------------


class _SlowClaim:
    """The real store, whose first claim write waits a whole lease TTL before it is made: what a
    claim meets when another process holds SQLite's write lock (the chaos soak's store-fault
    window). The lease it writes was counted from before the wait."""

    def __init__(self, inner: SqliteRunStore, wait_s: float) -> None:
        self.inner = inner
        self.wait_s = wait_s
        self.late_token: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def update_run(self, run_id: str, conditions: Any, update: Update, **kw: Any) -> Any:
        if self.late_token is None and is_claim(update):
            self.late_token = update.set["lease"]["token"]
            await asyncio.sleep(self.wait_s)  # the wait on the lock itself
        return await self.inner.update_run(run_id, conditions, update, **kw)


async def test_a_claim_that_lands_past_its_lease_margin_runs_nothing_and_the_run_is_adopted(
    fleet: Fleet,
) -> None:
    """SPEC §13.1. The late claim's lease can be taken by an adopter at any moment, before its
    first beat: its execution starts nothing — no `stop_others`, no node, no event — and sends
    no disposition; the redelivery adopts the run, which finishes once. (Before the fix it ran
    the node; in the chaos soak an adopter's claim landed 4 ms later and both ran it.)"""
    assert isinstance(fleet.store, SqliteRunStore)
    ttl = fleet.engine.lease_timing().ttl.total_seconds()
    store = _SlowClaim(fleet.store, wait_s=ttl + 0.2)
    await start_on(fleet, store)
    run = await fleet.launch(ONE_COMPUTE)
    done = await fleet.wait_status(run.run_id, "finished", within=30)
    assert store.late_token is not None
    events = await fleet.store.read_events(run.run_id)
    assert not [e.type for e in events if e.execution == store.late_token]
    claims = [(e.data["path"], e.execution) for e in events if e.type == "run_claimed"]
    assert len(claims) == 1 and claims[0][0] == "adoption", claims
    assert done.checkpoint is not None and done.checkpoint.outputs == {"a": {"x": 2}}
    assert [e.type for e in events].count("node_finished") == 1


ONE_COMPUTE = """\
name: one_sum
entry: a
nodes:
  a:
    kind: compute
    set:
      x: "1 + 1"
"""
