"""The DLQ backstop (SPEC §5.6): each max-delivered message is settled as an admission at
`num_delivered = max_deliver`, writing nothing before it has judged. `Backstop.settle(seq)` is
driven directly on messages put in the work stream; one test goes end to end through the
MAX_DELIVERIES advisory."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from nats.js.errors import NotFoundError

from engine.local import new_run_id
from publisher.dlq import DlqRecord
from publisher.errors import RecordNotFound
from runner.backstop import SPENT, Backstop
from runner.delivery_log import DeliveryLog, read_deliveries
from runner.runner import Runner
from store import RunDocument, RunStatus, StoreError, StoreUnavailable
from tests.runner.callables import (
    body,
    bound_drain,
    idle_runner,
    lease,
    new_run,
    open_fleet,
    publish_raw,
    workflow,
)
from tests.runner.conftest import Fleet, eventually
from tests.support.nats_server import NatsServer

S = RunStatus


@pytest.fixture(autouse=True)
async def _quick_drain(fleet: Fleet) -> AsyncIterator[None]:
    yield
    bound_drain(fleet.runners)


@pytest.fixture
async def backstop(fleet: Fleet) -> Backstop:
    runner = await idle_runner(fleet, owner="backstop-test")
    return Backstop(runner.svc)


async def put(fleet: Fleet, data: bytes, run_id: str | None = None, attempt: int = 1) -> int:
    """A message left in the work stream (as after max deliveries)."""
    ack = await publish_raw(
        fleet.js, fleet.names.runs_subject, data, run_id=run_id, attempt=attempt if run_id else None
    )
    return int(ack.seq)


async def put_for(fleet: Fleet, run_id: str, attempt: int = 1) -> int:
    return await put(fleet, body(run_id, attempt), run_id, attempt)


async def present(fleet: Fleet, seq: int) -> bool:
    try:
        await fleet.js.get_msg(fleet.names.runs_stream, seq)
    except NotFoundError:
        return False
    return True


async def record(fleet: Fleet, seq: int) -> DlqRecord | None:
    try:
        return await fleet.dlq.get(seq)
    except RecordNotFound:
        return None


async def create(fleet: Fleet, status: RunStatus, **fields: Any) -> RunDocument:
    doc = new_run("hello", run_id=new_run_id(), status=status, **fields)
    await fleet.store.create_run(doc)
    return await fleet.store.get_run(doc.run_id)


# -- the verdicts, in order -----------------------------------------------------------------------


async def test_backstop_message_gone_is_done(fleet: Fleet, backstop: Backstop) -> None:
    run = await create(fleet, S.QUEUED)
    seq = await put_for(fleet, run.run_id)
    await fleet.js.delete_msg(fleet.names.runs_stream, seq)
    assert await backstop.settle(seq) == ("gone", None)
    assert await record(fleet, seq) is None
    assert await fleet.store.get_run(run.run_id) == run


async def test_backstop_undecodable_message_is_recorded_malformed_and_deleted(
    fleet: Fleet, backstop: Backstop
) -> None:
    raw = b"\xde\xad not a message"
    seq = await put(fleet, raw)
    assert await backstop.settle(seq) == ("malformed", None)
    rec = await record(fleet, seq)
    assert rec is not None
    assert (rec.id, rec.reason, rec.replayable) == (seq, "malformed", False)
    assert await fleet.dlq.body(rec) == raw
    assert not await present(fleet, seq)


async def test_backstop_store_error_deletes_nothing(fleet: Fleet, backstop: Backstop) -> None:
    run = await create(fleet, S.QUEUED)
    seq = await put_for(fleet, run.run_id)

    class Down:
        async def get_run(self, run_id: str) -> RunDocument:
            raise StoreUnavailable("down")

    broken = Backstop(dataclasses.replace(backstop.svc, store=Down()))  # type: ignore[arg-type]
    with pytest.raises(StoreError):
        await broken.settle(seq)  # `settle_advisory` naks the advisory on this
    assert await present(fleet, seq)
    assert await record(fleet, seq) is None
    assert await fleet.store.get_run(run.run_id) == run


async def test_backstop_unknown_run_is_recorded_run_not_found_not_replayable_and_deleted(
    fleet: Fleet, backstop: Backstop
) -> None:
    run_id = new_run_id()
    seq = await put_for(fleet, run_id)
    assert await backstop.settle(seq) == ("run_not_found", None)
    rec = await record(fleet, seq)
    assert rec is not None
    assert (rec.reason, rec.run_id, rec.replayable) == ("run_not_found", run_id, False)
    assert not await present(fleet, seq)


async def test_backstop_superseded_message_is_deleted_without_a_park(
    fleet: Fleet, backstop: Backstop
) -> None:
    # The run itself would be parked (queued, lease free) if this copy were its own.
    run = await create(fleet, S.QUEUED, attempt=2)
    seq = await put_for(fleet, run.run_id, attempt=1)
    verdict, delay = await backstop.settle(seq)
    assert delay is None
    assert not await present(fleet, seq)
    assert await record(fleet, seq) is None
    assert await fleet.store.get_run(run.run_id) == run
    assert await fleet.store.read_events(run.run_id) == []
    assert verdict == "settled"


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (S.FINISHED, None),
        (S.FAILED, "TOOL_FAILED_PERMANENT"),
        (S.CANCELLED, None),
        (S.PAUSED_OPERATOR, "BUDGET_EXCEEDED"),
        (S.PAUSED_WAITING_HUMAN, None),
        (S.FAILED_RESUMABLE, "SCRATCH_NOT_PORTABLE"),
    ],
)
async def test_backstop_run_settled_at_that_attempt_is_deleted_without_a_record(
    fleet: Fleet, backstop: Backstop, status: RunStatus, code: str | None
) -> None:
    run = await create(fleet, status, failure_code=code)
    seq = await put_for(fleet, run.run_id)
    assert await backstop.settle(seq) == ("settled", None)
    assert not await present(fleet, seq)
    assert await record(fleet, seq) is None
    assert await fleet.store.get_run(run.run_id) == run


async def test_backstop_dlq_parked_run_without_its_record_gets_the_record_back(
    fleet: Fleet, backstop: Backstop
) -> None:
    # Its runner died between the park and the ack... and the record is missing.
    run = await create(fleet, S.FAILED_RESUMABLE, failure_code="DLQ_PARKED")
    seq = await put_for(fleet, run.run_id)
    assert await backstop.settle(seq) == ("settled", None)
    rec = await record(fleet, seq)
    assert rec is not None
    assert (rec.run_id, rec.attempt, rec.replayable) == (run.run_id, 1, True)
    assert not await present(fleet, seq)
    assert await fleet.store.get_run(run.run_id) == run


async def test_backstop_dlq_parked_run_with_its_record_keeps_that_record(
    fleet: Fleet, backstop: Backstop
) -> None:
    run = await create(fleet, S.FAILED_RESUMABLE, failure_code="DLQ_PARKED")
    data = body(run.run_id, 1)
    seq = await put(fleet, data, run.run_id, 1)
    await fleet.dlq.put(
        seq=seq, body=data, headers={}, reason="retries_exhausted", run_id=run.run_id, attempt=1
    )
    assert await backstop.settle(seq) == ("settled", None)
    rec = await record(fleet, seq)
    assert rec is not None and rec.reason == "retries_exhausted"
    assert not await present(fleet, seq)


async def test_backstop_lease_held_naks_the_advisory_until_expiry_plus_skew(
    fleet: Fleet, backstop: Backstop
) -> None:
    run = await create(fleet, S.RUNNING, lease=lease(1, ttl=3.0))
    seq = await put_for(fleet, run.run_id)
    verdict, delay = await backstop.settle(seq)
    assert verdict == "lease_held"
    assert delay is not None
    assert run.lease is not None
    # expires_at + skew (0.5 s) - now
    assert 3.0 <= delay <= 3.5 + 0.01
    assert await present(fleet, seq)
    assert await record(fleet, seq) is None
    assert await fleet.store.get_run(run.run_id) == run


@pytest.mark.parametrize(
    ("status", "fields", "cause"),
    [
        (S.QUEUED, {}, None),
        (S.RUNNING, {"lease": lease(1, ttl=-5.0)}, None),
        (S.FAILED_RESUMABLE, {"failure_code": "SANDBOX_LOST"}, "SANDBOX_LOST"),
    ],
    ids=["queued", "running_lease_free", "auto_resumable"],
)
async def test_backstop_otherwise_records_parks_dlq_parked_and_deletes(
    fleet: Fleet,
    backstop: Backstop,
    status: RunStatus,
    fields: dict[str, Any],
    cause: str | None,
) -> None:
    run = await create(fleet, status, **fields)
    seq = await put_for(fleet, run.run_id)
    assert await backstop.settle(seq) == ("parked", None)
    rec = await record(fleet, seq)
    assert rec is not None
    assert (rec.id, rec.reason, rec.run_id, rec.attempt) == (seq, "max_deliveries", run.run_id, 1)
    assert rec.replayable
    assert rec.num_delivered == fleet.wire.max_deliver
    parked = await fleet.store.get_run(run.run_id)
    assert (parked.status, parked.failure_code, parked.cause_code) == (
        S.FAILED_RESUMABLE,
        "DLQ_PARKED",
        cause,
    )
    assert parked.attempt == 1
    assert parked.lease is None
    events = await fleet.store.read_events(run.run_id)
    assert [(e.type, e.data) for e in events] == [
        ("run_dlq_parked", {"reason": "max_deliveries", "record_id": seq})
    ]
    assert not await present(fleet, seq)
    # Settling again (a redelivered advisory) finds the message gone: nothing more happens.
    assert await backstop.settle(seq) == ("gone", None)


async def test_a_park_after_deliveries_spent_while_the_owner_lived_says_who_held_the_run(
    fleet: Fleet, backstop: Backstop
) -> None:
    """A network drill: a runner cut off from NATS but not from the store kept its lease, the
    others nak'd every redelivery (§5.2), and when its execution ended unsettled the park
    said only that the message ran out of deliveries. The delivery log knows more."""
    held = await create(fleet, S.FAILED_RESUMABLE, failure_code="SANDBOX_LOST")
    plain = await create(fleet, S.FAILED_RESUMABLE, failure_code="SANDBOX_LOST")
    seq = await put_for(fleet, held.run_id)
    plain_seq = await put_for(fleet, plain.run_id)
    log = DeliveryLog(fleet.nc, fleet.names, "runner-b")
    await log.record(held.run_id, seq, 1, "claim", "fresh", attempt=1, runner="runner-cut-off")
    for n in (2, 3, 4):
        await log.record(held.run_id, seq, n, "nak", "redelivery_while_owner_lives", attempt=1)
    await log.record(held.run_id, seq + 100, 1, "nak", "redelivery_while_owner_lives")  # not it
    await log.record(plain.run_id, plain_seq, 1, "nak", "transient", attempt=1)

    async def logged() -> bool:
        entries = await read_deliveries(fleet.js, fleet.names, held.run_id)
        others = await read_deliveries(fleet.js, fleet.names, plain.run_id)
        return len(entries) == 5 and len(others) == 1

    await eventually(logged)
    assert await backstop.settle(seq) == ("parked", None)
    assert await backstop.settle(plain_seq) == ("parked", None)

    said = (await fleet.store.get_run(held.run_id)).error or ""
    assert said.startswith(SPENT)
    assert "3 of its deliveries came while runner-cut-off held the run" in said
    assert "cut off from NATS" in said
    assert (await fleet.store.get_run(plain.run_id)).error == SPENT


async def test_backstop_lease_expired_within_the_skew_is_still_held(
    fleet: Fleet, backstop: Backstop
) -> None:
    run = await create(fleet, S.RUNNING, lease=lease(1, ttl=-0.2))
    seq = await put_for(fleet, run.run_id)
    verdict, delay = await backstop.settle(seq)
    assert verdict == "lease_held" and delay is not None and delay <= 0.5
    assert (await fleet.store.get_run(run.run_id)).status is S.RUNNING


# -- end to end -----------------------------------------------------------------------------------


@pytest.fixture
async def small_fleet(tmp_path: Path, nats_server: NatsServer) -> AsyncIterator[Fleet]:
    async with open_fleet(tmp_path / "small", nats_server, max_deliver=2) as fleet:
        yield fleet


async def test_max_deliveries_advisory_reaches_the_backstop_which_parks_the_run(
    small_fleet: Fleet,
) -> None:
    fleet = small_fleet
    run = await fleet.launch(workflow("hello").source)
    assert run.publication is not None
    seq = run.publication.stream_seq
    assert seq is not None
    # No runner: a consumer that fetches and never acks (each nak redelivers at once).
    psub = await fleet.js.pull_subscribe_bind(fleet.names.consumer, stream=fleet.names.runs_stream)
    try:
        for n in (1, 2):
            [msg] = await psub.fetch(1, timeout=5)
            assert msg.metadata.num_delivered == n
            await msg.nak()
        # The server notices the limit when it next tries to deliver: nothing comes back.
        with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
            await psub.fetch(1, timeout=0.5)
    finally:
        await psub.unsubscribe()

    async def advisories() -> int:
        info = await fleet.js.stream_info(fleet.names.advisory_stream)
        return int(info.state.messages)

    await eventually(advisories, within=10)
    assert await present(fleet, seq)  # after MaxDeliver the message stays in the stream
    assert (await fleet.store.get_run(run.run_id)).status is S.QUEUED
    # A runner comes up later: its backstop reads the captured advisory and settles it.
    runner: Runner = await fleet.start_runner(sweeper=False)
    parked = await fleet.wait_status(run.run_id, "failed_resumable", within=15)
    assert (parked.failure_code, parked.cause_code) == ("DLQ_PARKED", None)
    rec = await record(fleet, seq)
    assert rec is not None and (rec.reason, rec.run_id) == ("max_deliveries", run.run_id)

    async def settled() -> bool:
        info = await fleet.js.consumer_info(
            fleet.names.advisory_stream, fleet.names.backstop_consumer
        )
        return not await present(fleet, seq) and info.num_ack_pending == 0

    await eventually(settled, within=10)
    assert (
        runner.metrics.registry.get_sample_value(
            "runfleet_dlq_records_total", {"reason": "max_deliveries"}
        )
        == 1.0
    )
