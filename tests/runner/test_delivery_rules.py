"""Admission rules on a live runner (SPEC §5.2, §5.3, §5.7, §5.8): real nats-server, real
SQLite store, deliveries crafted by hand where a rule needs a precise state."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from engine.config import EngineSettings
from engine.local import new_run_id
from engine.resume import ResumeRequest
from publisher.dlq import DlqRecord
from publisher.errors import RecordNotFound
from runner.runner import Runner
from store import (
    Budget,
    BudgetUsage,
    CasConflict,
    Checkpoint,
    Consents,
    Eq,
    ResumeSpec,
    RunDocument,
    RunStatus,
    ScratchRecord,
    Update,
    utcnow,
)
from store.sqlite import SqliteRunStore
from tests.runner.callables import (
    body,
    bound_drain,
    entered,
    failed_at_hold,
    ghost_owner,
    lease,
    new_run,
    publish_raw,
    release,
    sample,
    workflow,
)
from tests.runner.conftest import LEASE, Fleet, deliveries, eventually, reaches

S = RunStatus
UNBANKABLE = ScratchRecord(state="unbankable", bytes=10)


@pytest.fixture(autouse=True)
async def _quick_drain(fleet: Fleet) -> AsyncIterator[None]:
    yield
    bound_drain(fleet.runners)


@pytest.fixture
async def runner(fleet: Fleet) -> Runner:
    return await fleet.start_runner(sweeper=False, backstop=False)


async def gone(fleet: Fleet, seq: int) -> bool:
    try:
        await fleet.js.get_msg(fleet.names.runs_stream, seq)
    except NotFoundError:
        return True
    return False


async def wait_gone(fleet: Fleet, seq: int) -> None:
    async def probe() -> bool:
        return await gone(fleet, seq)

    await eventually(probe, within=10)


async def dlq_record(fleet: Fleet, seq: int) -> DlqRecord | None:
    try:
        return await fleet.dlq.get(seq)
    except RecordNotFound:
        return None


async def wait_record(fleet: Fleet, seq: int, within: float = 10.0) -> DlqRecord:
    async def probe() -> DlqRecord | None:
        return await dlq_record(fleet, seq)

    return await eventually(probe, within=within)


async def event_types(fleet: Fleet, run_id: str) -> list[str]:
    return [e.type for e in await fleet.store.read_events(run_id)]


async def publish(fleet: Fleet, run_id: str, attempt: int, **fields: Any) -> int:
    ack = await publish_raw(
        fleet.js,
        fleet.names.runs_subject,
        body(run_id, attempt, **fields),
        run_id=run_id,
        attempt=attempt,
    )
    return int(ack.seq)


def consent_paths(value: Any, path: str = "") -> list[str]:
    """Every place a consent could hide in a stored document."""
    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if key in {"consents", "force", "accept_scratch_loss"}:
                found.append(here)
            found.extend(consent_paths(item, here))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found.extend(consent_paths(item, f"{path}[{i}]"))
    return found


def consents_outside_resume_spec(doc: RunDocument) -> list[str]:
    return consent_paths(doc.model_dump(mode="json", exclude={"resume_spec"}))


# -- step 3: superseded ---------------------------------------------------------------------------


async def test_superseded_delivery_writes_nothing_and_is_acked(
    fleet: Fleet, runner: Runner
) -> None:
    run_id = new_run_id()
    await fleet.store.create_run(new_run("hello", run_id=run_id, status=S.QUEUED, attempt=2))
    before = await fleet.store.get_run(run_id)
    seq = await publish(fleet, run_id, 1)
    await reaches(runner, "ack", "superseded")
    await wait_gone(fleet, seq)
    after = await fleet.store.get_run(run_id)
    assert after == before  # version, status, lease, publication: nothing written
    assert await fleet.store.read_events(run_id) == []


# -- step 5: duplicate, redelivery while the owner lives, busy -----------------------------------


async def test_second_message_for_the_attempt_of_a_live_execution_is_acked_as_duplicate_and_never_parks_the_run(  # noqa: E501
    fleet: Fleet, runner: Runner, gates: Path
) -> None:
    run = await fleet.launch(workflow("hold").source, {"dir": str(gates)})

    async def holding() -> bool:
        return entered(gates, run.run_id) == [1]

    await eventually(holding)
    claimed = await fleet.store.get_run(run.run_id)
    assert claimed.lease is not None
    dup = await publish_raw(
        fleet.js,
        fleet.names.runs_subject,
        body(run.run_id, 1),
        run_id=run.run_id,
        attempt=1,
        id_=f"{run.run_id}:1:dup",
    )
    assert not dup.duplicate
    await reaches(runner, "ack", "duplicate")
    await wait_gone(fleet, dup.seq)
    now = await fleet.store.get_run(run.run_id)
    assert now.status is S.RUNNING
    assert now.lease is not None and now.lease.token == claimed.lease.token
    assert now.lease.stream_seq == claimed.lease.stream_seq != dup.seq
    release(gates, run.run_id)
    done = await fleet.wait_status(run.run_id, "finished", "failed_resumable", "failed")
    assert done.status is S.FINISHED
    assert done.failure_code is None and done.cause_code is None
    types = await event_types(fleet, run.run_id)
    assert "run_dlq_parked" not in types
    assert types.count("run_claimed") == 1
    assert entered(gates, run.run_id) == [1]
    assert await fleet.queue_drained()


async def test_redelivery_while_owner_lives_is_nakd_one_lease_interval(fleet: Fleet) -> None:
    run_id = new_run_id()
    owner = lease(1)
    await fleet.store.create_run(new_run("hello", run_id=run_id, status=S.RUNNING, lease=owner))
    seq = await publish(fleet, run_id, 1)
    # The owner claimed this very delivery (its lease carries the sequence) and lives on.
    stamped = await fleet.store.update_run(
        run_id, [Eq("lease.token", owner.token)], Update(set={"lease.stream_seq": seq})
    )
    assert not isinstance(stamped, CasConflict)
    async with ghost_owner(fleet.store, run_id, owner.token):
        runner = await fleet.start_runner(sweeper=False, backstop=False)
        first = await reaches(runner, "nak", "redelivery_while_owner_lives", 1)
        second = await reaches(runner, "nak", "redelivery_while_owner_lives", 2)
        assert second - first >= 0.8  # one lease interval (1 s), not an immediate redelivery
        assert (await fleet.store.get_run(run_id)).status is S.RUNNING
        assert await fleet.store.read_events(run_id) == []
    # The owner died: its lease lapses, and the next redelivery adopts the run.
    done = await fleet.wait_status(run_id, "finished", within=15)
    claims = [e for e in await fleet.store.read_events(run_id) if e.type == "run_claimed"]
    assert [e.data["path"] for e in claims] == ["adoption"]
    assert done.lease is None


async def test_busy_resume_waits_on_the_ladder_then_runs(fleet: Fleet) -> None:
    run_id = new_run_id()
    unwinding = lease(1)  # the previous execution still unwinds (banking, say)
    await fleet.store.create_run(
        new_run(
            "hello",
            run_id=run_id,
            status=S.FAILED_RESUMABLE,
            failure_code="AMBIGUOUS_EFFECT",
            lease=unwinding,
        )
    )
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    async with ghost_owner(fleet.store, run_id, unwinding.token):
        resumed = await fleet.publisher.resume(run_id, ResumeRequest(), tenant="default")
        assert (resumed.status, resumed.attempt) == (S.QUEUED, 2)
        first = await reaches(runner, "nak", "busy", 1)
        second = await reaches(runner, "nak", "busy", 2)
        assert second - first >= 0.8  # the ladder starts at one lease interval
        assert (await fleet.store.get_run(run_id)).status is S.QUEUED
    lapsed = (await fleet.store.get_run(run_id)).lease
    assert lapsed is not None and lapsed.token == unwinding.token
    done = await fleet.wait_status(run_id, "finished", within=20)
    assert done.attempt == 2
    claims = [e for e in await fleet.store.read_events(run_id) if e.type == "run_claimed"]
    assert [(e.data["path"], e.attempt) for e in claims] == [("fresh", 2)]
    # Claimed only once the old lease was free (its expiry + skew).
    assert claims[0].at >= lapsed.expires_at + timedelta(seconds=0.5)
    assert deliveries(runner, "nak", "busy") >= 2


# -- step 6: a stale cancel flag ------------------------------------------------------------------


async def test_stale_cancel_flag_is_written_as_cancelled_and_acked(
    fleet: Fleet, runner: Runner
) -> None:
    run_id = new_run_id()
    await fleet.store.create_run(
        new_run("hello", run_id=run_id, status=S.QUEUED, cancel_requested=True)
    )
    seq = await publish(fleet, run_id, 1)
    done = await fleet.wait_status(run_id, "cancelled")
    assert done.cancel_requested is False
    assert done.lease is None
    await reaches(runner, "ack", "cancelled")
    await wait_gone(fleet, seq)
    assert await event_types(fleet, run_id) == ["run_cancelled"]


# -- step 7: engine refusals before the claim -----------------------------------------------------


async def test_scratch_refusal_on_the_fresh_path_returns_the_run_to_its_prior_status(
    fleet: Fleet, runner: Runner
) -> None:
    run_id = new_run_id()
    await fleet.store.create_run(
        new_run(
            "hello",
            run_id=run_id,
            status=S.QUEUED,
            attempt=2,
            scratch=UNBANKABLE,
            checkpoint=Checkpoint(restart_node="a"),
            resume_spec=ResumeSpec(attempt=2, prior_status=S.PAUSED_OPERATOR),
        )
    )
    seq = await publish(fleet, run_id, 2, kind="resume")
    back = await fleet.wait_status(run_id, "paused_operator", "failed_resumable", "running")
    assert back.status is S.PAUSED_OPERATOR
    assert (back.failure_code, back.attempt) == ("SCRATCH_NOT_PORTABLE", 2)
    assert back.error
    assert back.lease is None
    await reaches(runner, "ack", "refused_scratch")
    await wait_gone(fleet, seq)
    events = await fleet.store.read_events(run_id)
    assert [(e.type, e.data.get("code")) for e in events] == [
        ("run_failed", "SCRATCH_NOT_PORTABLE")
    ]


async def test_scratch_refusal_on_the_adoption_path_parks_scratch_not_portable(
    fleet: Fleet, runner: Runner
) -> None:
    run_id = new_run_id()
    await fleet.store.create_run(
        new_run(
            "hello",
            run_id=run_id,
            status=S.RUNNING,
            scratch=UNBANKABLE,
            checkpoint=Checkpoint(restart_node="a"),
            lease=lease(1, ttl=-5),
        )
    )
    await publish(fleet, run_id, 1)
    parked = await fleet.wait_status(run_id, "failed_resumable", "finished")
    assert parked.failure_code == "SCRATCH_NOT_PORTABLE"
    assert "run_claimed" not in await event_types(fleet, run_id)


async def test_budget_refusal_parks_paused_operator_before_any_sandbox(
    fleet: Fleet, runner: Runner
) -> None:
    run_id = new_run_id()
    await fleet.store.create_run(
        new_run(
            "tool",
            run_id=run_id,
            status=S.QUEUED,
            budget=Budget(max_iterations=3),
            checkpoint=Checkpoint(restart_node="shell", usage=BudgetUsage(iterations=3)),
        )
    )
    seq = await publish(fleet, run_id, 1)
    parked = await fleet.wait_status(run_id, "paused_operator", "finished", "failed")
    assert parked.status is S.PAUSED_OPERATOR
    assert parked.failure_code == "BUDGET_EXCEEDED"
    assert "max_iterations" in (parked.error or "")
    assert parked.lease is None
    await reaches(runner, "ack", "refused_budget")
    await wait_gone(fleet, seq)
    events = await fleet.store.read_events(run_id)
    assert [(e.type, e.data) for e in events] == [
        ("run_paused", {"kind": "budget", "code": "BUDGET_EXCEEDED"})
    ]
    # Never claimed, so nothing started.
    assert (
        sample(runner.metrics.registry, "runfleet_claims_total", path="fresh", outcome="won") == 0
    )
    assert await runner.driver.list_sandboxes() == []
    assert not (fleet.tmp / "data" / "work" / run_id).exists()


# -- step 8: a lost claim ------------------------------------------------------------------------


class RacingStore:
    """The real store, with another writer racing the claim: each of the first `races` reads
    of the run is followed by a write that bumps its version, so the claim judged on that
    read loses its CAS."""

    def __init__(self, inner: SqliteRunStore, run_id: str, races: int) -> None:
        self.inner = inner
        self.run_id = run_id
        self.races = races

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get_run(self, run_id: str) -> RunDocument:
        doc = await self.inner.get_run(run_id)
        if run_id == self.run_id and self.races > 0:
            self.races -= 1
            await self.inner.update_run(run_id, [], Update(set={"metrics.raced": self.races}))
        return doc


async def test_lost_claim_reenters_admission_at_most_three_times(fleet: Fleet) -> None:
    run_id = new_run_id()
    await fleet.store.create_run(new_run("hello", run_id=run_id, status=S.QUEUED))
    inner = fleet.store
    assert isinstance(inner, SqliteRunStore)
    fleet.store = RacingStore(inner, run_id, races=4)  # type: ignore[assignment]
    try:
        runner = await fleet.start_runner(sweeper=False, backstop=False)
    finally:
        fleet.store = inner
    await publish(fleet, run_id, 1)
    await reaches(runner, "nak", "claim_lost")
    # The redelivery (after the transient delay) reads a quiet document and wins.
    await fleet.wait_status(run_id, "finished")
    registry = runner.metrics.registry
    lost = sample(registry, "runfleet_claims_total", path="fresh", outcome="lost")
    won = sample(registry, "runfleet_claims_total", path="fresh", outcome="won")
    assert (lost, won) == (4, 1)  # the first try and three re-entries, then a nak
    assert deliveries(runner, "nak", "claim_lost") == 1


# -- steps 1-2: decode, load ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe not json", b"[1, 2]", b'{"v": 1, "run_id": "x"}', b'{"v": "one"}'],
    ids=["bytes", "array", "missing_fields", "bad_v"],
)
async def test_malformed_message_is_dead_lettered_as_malformed_and_acked(
    fleet: Fleet, runner: Runner, raw: bytes
) -> None:
    ack = await fleet.js.publish(
        fleet.names.runs_subject, raw, headers={"Nats-Msg-Id": "junk", "X-Origin": "test"}
    )
    record = await wait_record(fleet, ack.seq)
    assert record.id == ack.seq
    assert record.reason == "malformed"
    assert record.replayable is False
    assert record.run_id is None
    assert await fleet.dlq.body(record) == raw
    assert record.headers["X-Origin"] == "test"
    assert record.num_delivered == 1
    await wait_gone(fleet, ack.seq)
    await reaches(runner, "dlq", "malformed")


async def test_unknown_run_older_than_thirty_seconds_is_dead_lettered_not_replayable(
    fleet: Fleet, runner: Runner
) -> None:
    run_id = new_run_id()
    seq = await publish(fleet, run_id, 1, published_at=utcnow() - timedelta(seconds=31))
    record = await wait_record(fleet, seq)
    assert (record.reason, record.replayable, record.run_id) == ("run_not_found", False, run_id)
    await wait_gone(fleet, seq)


async def test_young_unknown_run_is_nakd_as_a_lagging_read_not_dead_lettered(
    fleet: Fleet, runner: Runner
) -> None:
    run_id = new_run_id()
    seq = await publish(fleet, run_id, 1)
    await reaches(runner, "nak", "run_not_found_yet", 2)
    assert await dlq_record(fleet, seq) is None
    assert not await gone(fleet, seq)
    # The read catches up: the next delivery finds the run and runs it.
    await fleet.store.create_run(new_run("hello", run_id=run_id, status=S.QUEUED))
    await fleet.wait_status(run_id, "finished")
    assert await dlq_record(fleet, seq) is None


async def test_tenant_mismatch_is_dead_lettered(fleet: Fleet, runner: Runner) -> None:
    run_id = new_run_id()
    await fleet.store.create_run(new_run("hello", run_id=run_id, status=S.QUEUED, tenant="acme"))
    before = await fleet.store.get_run(run_id)
    seq = await publish(fleet, run_id, 1, tenant="default")
    record = await wait_record(fleet, seq)
    assert (record.reason, record.run_id) == ("tenant_mismatch", run_id)
    await wait_gone(fleet, seq)
    assert await fleet.store.get_run(run_id) == before
    assert await fleet.store.read_events(run_id) == []


async def test_newer_schema_is_nakd_not_dead_lettered_before_the_last_delivery(
    fleet: Fleet,
) -> None:
    runner = await fleet.start_runner(
        sweeper=False, backstop=False, unsupported_schema_delay="0.1s"
    )
    run_id = new_run_id()
    await fleet.store.create_run(new_run("hello", run_id=run_id, status=S.QUEUED))
    seq = await publish(fleet, run_id, 1, v=2, future_field=True)
    record = await wait_record(fleet, seq, within=15)
    max_deliver = fleet.wire.max_deliver
    assert (record.reason, record.num_delivered) == ("unsupported_schema", max_deliver)
    assert deliveries(runner, "nak", "unsupported_schema") == max_deliver - 1
    await wait_gone(fleet, seq)
    assert (await fleet.store.get_run(run_id)).status is S.QUEUED


# -- §5.8: an operator cancel reaches a running execution ----------------------------------------


async def test_operator_cancel_reaches_a_running_execution_through_the_control_subject(
    fleet: Fleet, gates: Path
) -> None:
    # Lease beats every 20 s here, so only the control subject can bring the cancel in time.
    fleet.engine = EngineSettings(
        **{**LEASE, "lease_ttl": "60s", "lease_interval": "20s", "lease_loss_margin": "5s"}
    )
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    run = await fleet.launch(workflow("hold").source, {"dir": str(gates)})

    async def holding() -> bool:
        return entered(gates, run.run_id) == [1]

    await eventually(holding)
    await fleet.publisher.cancel(run.run_id, tenant="default")
    done = await fleet.wait_status(run.run_id, "cancelled", "finished", within=5)
    assert done.status is S.CANCELLED
    assert done.cancel_requested is False
    assert done.checkpoint is not None and done.checkpoint.restart_node == "hold"
    refreshes = sample(runner.metrics.registry, "runfleet_lease_refreshes_total", outcome="ok")
    assert refreshes == 0
    assert "run_cancelled" in await event_types(fleet, run.run_id)
    await eventually(lambda: _no_messages(fleet), within=5)


async def _no_messages(fleet: Fleet) -> bool:
    return await fleet.stream_messages() == 0


async def test_operator_cancel_reaches_a_running_execution_through_the_refresh_read(
    fleet: Fleet, runner: Runner, gates: Path
) -> None:
    run = await fleet.launch(workflow("hold").source, {"dir": str(gates)})

    async def holding() -> bool:
        return entered(gates, run.run_id) == [1]

    await eventually(holding)
    flagged = await fleet.store.update_run(
        run.run_id, [Eq("status", S.RUNNING)], Update(set={"cancel_requested": True})
    )
    assert not isinstance(flagged, CasConflict)  # no control message is sent
    done = await fleet.wait_status(run.run_id, "cancelled", "finished", within=8)
    assert done.status is S.CANCELLED
    assert done.checkpoint is not None and done.checkpoint.restart_node == "hold"
    await eventually(lambda: _no_messages(fleet), within=5)


# -- §5.7: consent scoping ------------------------------------------------------------------------


async def test_redelivery_of_a_resume_does_not_lend_force_or_accept_scratch_loss(
    fleet: Fleet, runner: Runner, gates: Path
) -> None:
    run_id = new_run_id()
    v2 = workflow("hold_v2")
    await fleet.store.create_run(
        failed_at_hold(run_id, gates, "SCRATCH_NOT_PORTABLE", scratch=UNBANKABLE)
    )
    resumed = await fleet.publisher.resume(
        run_id,
        ResumeRequest(force=True, accept_scratch_loss=True, new_source=v2),
        tenant="default",
    )
    assert resumed.attempt == 2

    async def holding() -> bool:
        return entered(gates, run_id) == [2]

    await eventually(holding)
    claimed = await fleet.store.get_run(run_id)
    # The fresh claim of attempt 2 wrote the consents' effects...
    assert claimed.workflow.source_hash == v2.source_hash
    assert claimed.scratch is not None and claimed.scratch.forsaken
    assert claimed.resume_spec is not None and claimed.resume_spec.attempt == 2
    assert claimed.resume_spec.consents == Consents(force=True, accept_scratch_loss=True)
    # ...and the consents themselves live nowhere but in `resume_spec`.
    assert consents_outside_resume_spec(claimed) == []
    assert claimed.lease is not None

    # The runner dies mid-node (its lease lapses) after having recorded a new scratch that
    # cannot follow the run. The same delivery comes back after ack_wait, now an adoption.
    crashed = await fleet.store.update_run(
        run_id,
        [Eq("lease.token", claimed.lease.token)],
        Update(
            set={
                "lease.token": "crashed",
                "lease.expires_at": utcnow() - timedelta(seconds=10),
                "scratch": UNBANKABLE.model_dump(),
            }
        ),
    )
    assert not isinstance(crashed, CasConflict)
    parked = await fleet.wait_status(run_id, "failed_resumable", "finished", within=15)
    assert (parked.status, parked.failure_code) == (S.FAILED_RESUMABLE, "SCRATCH_NOT_PORTABLE")
    assert parked.attempt == 2
    assert parked.scratch is not None and not parked.scratch.forsaken  # not accepted again
    assert parked.workflow.source_hash == v2.source_hash
    assert consents_outside_resume_spec(parked) == []
    # The ack follows the parking write (and its event's): wait for it, then count exactly.
    await reaches(runner, "ack", "refused_scratch")
    assert deliveries(runner, "ack", "refused_scratch") == 1
    claims = [e for e in await fleet.store.read_events(run_id) if e.type == "run_claimed"]
    assert [e.data["path"] for e in claims] == ["fresh"]
    assert entered(gates, run_id) == [2]


async def test_an_older_attempts_message_with_consents_in_its_body_lends_nothing(
    fleet: Fleet, runner: Runner
) -> None:
    run_id = new_run_id()
    await fleet.store.create_run(
        new_run(
            "hello",
            run_id=run_id,
            status=S.QUEUED,
            attempt=2,
            scratch=UNBANKABLE,
            checkpoint=Checkpoint(restart_node="a"),
            resume_spec=ResumeSpec(attempt=2, prior_status=S.FAILED_RESUMABLE),
        )
    )
    before = await fleet.store.get_run(run_id)
    forged = {"resume": {"consents": {"force": True, "accept_scratch_loss": True}}}
    stale = await publish(fleet, run_id, 1, kind="resume", **forged)
    await reaches(runner, "ack", "superseded")
    await wait_gone(fleet, stale)
    assert await fleet.store.get_run(run_id) == before
    # Even this attempt's own message cannot lend what its `resume_spec` does not hold.
    await publish(fleet, run_id, 2, kind="resume", **forged)
    back = await fleet.wait_status(run_id, "failed_resumable", "running", "finished")
    assert (back.status, back.failure_code) == (S.FAILED_RESUMABLE, "SCRATCH_NOT_PORTABLE")
    assert back.scratch is not None and not back.scratch.forsaken
    assert consents_outside_resume_spec(back) == []
