"""The backstop's edges (issue 12 item 6 and item 2, SPEC §5.1, §5.2 step 2, §5.6, §13.12): it
records, then parks by CAS (§5.6's order) and takes the record back when that CAS loses, checks
the tenant as admission does, and no advisory or body — nor any error one message makes
`settle` raise — stops `Backstop.loop()`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from publisher.dlq import DlqRecord, DlqStore
from runner.backstop import UNRECORDABLE_NAK, Backstop, advisory_seq
from store import CasConflict, Eq, RunDocument, RunStatus, RunStore, Update
from tests.runner.callables import body, bound_drain, idle_runner, lease, publish_raw
from tests.runner.conftest import Fleet, eventually
from tests.runner.test_backstop import create, present, put, put_for, record

S = RunStatus
DEEP = b"[" * 200_000 + b"]" * 200_000
HUGE = b"9" * 5_000


@pytest.fixture(autouse=True)
async def _quick_drain(fleet: Fleet) -> AsyncIterator[None]:
    yield
    bound_drain(fleet.runners)


@pytest.fixture
async def backstop(fleet: Fleet) -> Backstop:
    runner = await idle_runner(fleet, owner="backstop-hardening")
    return Backstop(runner.svc)


class Crash(BaseException):
    """Stands for the process dying at that point: no handler of the product's runs (none
    catches more than `Exception`)."""


class RivalStore:
    """The real store; `rival` runs once, just before the first `update_run` goes through."""

    def __init__(self, inner: RunStore, rival: Callable[[], Awaitable[object]]) -> None:
        self.inner = inner
        self.rival: Callable[[], Awaitable[object]] | None = rival

    async def update_run(self, *args: Any, **kwargs: Any) -> Any:
        if self.rival is not None:
            rival, self.rival = self.rival, None
            await rival()
        return await self.inner.update_run(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FailingStore:
    """The real store, except `get_run` of one run raises an unexpected error."""

    def __init__(self, inner: RunStore, run_id: str) -> None:
        self.inner = inner
        self.run_id = run_id

    async def get_run(self, run_id: str) -> RunDocument:
        if run_id == self.run_id:
            raise RuntimeError("injected: an error nobody expected")
        return await self.inner.get_run(run_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class UnwritableDlq:
    """The real DLQ store, except `put` fails (the DLQ cannot be written)."""

    def __init__(self, inner: DlqStore) -> None:
        self.inner = inner

    async def put(self, **_: Any) -> DlqRecord:
        raise OSError("injected: the DLQ cannot be written")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def rebuilt(backstop: Backstop, **parts: Any) -> Backstop:
    return Backstop(dataclasses.replace(backstop.svc, **parts))


# -- record, then park (SPEC §5.6) ----------------------------------------------------------------


class CrashingStore:
    """The real store, except `update_run` dies (the process, between the record and the park)."""

    def __init__(self, inner: RunStore) -> None:
        self.inner = inner

    async def update_run(self, *args: Any, **kwargs: Any) -> Any:
        raise Crash

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_backstop_records_then_parks_and_takes_the_record_back_when_its_park_cas_loses(
    fleet: Fleet, backstop: Backstop
) -> None:
    run = await create(fleet, S.QUEUED)
    seq = await put_for(fleet, run.run_id)
    at_cas: list[DlqRecord | None] = []

    async def fresh_claim() -> object:
        # SPEC §5.6's order: the record stands when the park's CAS is sent. A runner claims the
        # run between the backstop's read and that CAS.
        at_cas.append(await record(fleet, seq))
        return await fleet.store.update_run(
            run.run_id,
            [Eq("status", S.QUEUED)],
            Update(set={"status": S.RUNNING, "lease": lease(1, ttl=30).model_dump()}),
        )

    racing = rebuilt(backstop, store=RivalStore(fleet.store, fresh_claim))
    assert await racing.settle(seq) == ("raced", 1.0)
    assert at_cas[0] is not None and at_cas[0].reason == "max_deliveries"
    assert await record(fleet, seq) is None  # taken back: the run was not parked
    assert await present(fleet, seq)
    doc = await fleet.store.get_run(run.run_id)
    assert (doc.status, doc.failure_code) == (S.RUNNING, None)
    assert await fleet.store.read_events(run.run_id) == []


async def test_backstop_crash_between_record_and_park_parks_on_the_advisorys_redelivery(
    fleet: Fleet, backstop: Backstop
) -> None:
    run = await create(fleet, S.QUEUED)
    seq = await put_for(fleet, run.run_id)
    dying = rebuilt(backstop, store=CrashingStore(fleet.store))
    with pytest.raises(Crash):
        await dying.settle(seq)
    assert await fleet.store.get_run(run.run_id) == run  # not parked
    assert await record(fleet, seq) is not None and await present(fleet, seq)

    # The advisory comes back (it was never acked): record again (the same id), then park.
    assert await backstop.settle(seq) == ("parked", None)
    rec = await record(fleet, seq)
    assert rec is not None
    assert (rec.reason, rec.run_id, rec.attempt, rec.replayable) == (
        "max_deliveries",
        run.run_id,
        1,
        True,
    )
    assert not await present(fleet, seq)
    parked = await fleet.store.get_run(run.run_id)
    assert (parked.status, parked.failure_code) == (S.FAILED_RESUMABLE, "DLQ_PARKED")
    assert [(e.type, e.data) for e in await fleet.store.read_events(run.run_id)] == [
        ("run_dlq_parked", {"reason": "max_deliveries", "record_id": seq})
    ]


async def test_backstop_withdraws_a_record_whose_park_never_happened_once_the_run_settled_elsewhere(
    fleet: Fleet, backstop: Backstop
) -> None:
    run = await create(fleet, S.QUEUED)
    seq = await put_for(fleet, run.run_id)
    with pytest.raises(Crash):
        await rebuilt(backstop, store=CrashingStore(fleet.store)).settle(seq)
    assert await record(fleet, seq) is not None
    # Before the advisory comes back, an operator cancelled the run at that attempt.
    done = await fleet.store.update_run(
        run.run_id, [Eq("status", S.QUEUED)], Update(set={"status": S.CANCELLED})
    )
    assert not isinstance(done, CasConflict)
    assert await backstop.settle(seq) == ("settled", None)
    assert await record(fleet, seq) is None  # no replay may un-cancel a run never parked
    assert not await present(fleet, seq)
    assert await fleet.store.read_events(run.run_id) == []


async def test_backstop_restores_the_record_of_a_park_whose_record_is_missing(
    fleet: Fleet, backstop: Backstop
) -> None:
    run = await create(fleet, S.QUEUED)
    seq = await put_for(fleet, run.run_id)
    assert await backstop.settle(seq) == ("parked", None)
    parked = await fleet.store.get_run(run.run_id)
    await fleet.dlq.delete(seq)  # the record is gone (by hand), the park stands
    again = await publish_raw(
        fleet.js, fleet.names.runs_subject, body(run.run_id, 1), id_=f"{run.run_id}:1:again"
    )
    seq2 = int(again.seq)
    assert await backstop.settle(seq2) == ("settled", None)
    rec = await record(fleet, seq2)
    assert rec is not None and rec.reason == "max_deliveries"
    assert len(await fleet.store.read_events(run.run_id)) == 1  # the park's event, not twice
    assert await fleet.store.get_run(run.run_id) == parked


# -- the tenant, as admission checks it -----------------------------------------------------------


async def test_backstop_checks_the_tenant_as_admission_does(
    fleet: Fleet, backstop: Backstop
) -> None:
    # Queued, lease free: a copy of the run's own tenant would park it.
    run = await create(fleet, S.QUEUED)
    seq = await put(fleet, body(run.run_id, 1, tenant="intruder"), run.run_id, 1)
    assert await backstop.settle(seq) == ("tenant_mismatch", None)
    rec = await record(fleet, seq)
    assert rec is not None
    assert (rec.reason, rec.run_id, rec.replayable) == ("tenant_mismatch", run.run_id, False)
    assert not await present(fleet, seq)
    assert await fleet.store.get_run(run.run_id) == run
    assert await fleet.store.read_events(run.run_id) == []


async def test_backstop_records_a_newer_schema_at_the_last_delivery_as_unsupported_schema(
    fleet: Fleet, backstop: Backstop
) -> None:
    run = await create(fleet, S.QUEUED)
    seq = await put(fleet, body(run.run_id, 1, v=2), run.run_id, 1)
    assert await backstop.settle(seq) == ("unsupported_schema", None)
    rec = await record(fleet, seq)
    assert rec is not None and (rec.reason, rec.replayable) == ("unsupported_schema", False)
    assert not await present(fleet, seq)
    assert await fleet.store.get_run(run.run_id) == run


# -- no single message stops the loop -------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "seq"),
    [
        (b'{"stream_seq": 42}', 42),
        (b'{"stream_seq": 18446744073709551615}', 2**64 - 1),
        (DEEP, None),
        (b'{"stream_seq": ' + DEEP + b"}", None),
        (b'{"stream_seq": ' + HUGE + b"}", None),
        (b'{"stream_seq": 1' + b"0" * 30 + b"}", None),
        (b'{"stream_seq": 0}', None),
        (b'{"stream_seq": -3}', None),
        (b'{"stream_seq": 4.0}', None),
        (b'{"stream_seq": true}', None),
        (b'{"stream_seq": "42"}', None),
        (b"[42]", None),
        (b"\xff\xfe", None),
        (b"", None),
    ],
    ids=lambda v: repr(v[:24]) if isinstance(v, bytes) else str(v),
)
def test_advisory_seq_reads_only_a_uint64_stream_seq_and_never_raises(
    data: bytes, seq: int | None
) -> None:
    assert advisory_seq(data) == seq


@contextlib.asynccontextmanager
async def looping(backstop: Backstop) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.ensure_future(backstop.loop())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if backstop.psub is not None:
            await backstop.psub.unsubscribe()


async def test_backstop_loop_survives_every_hostile_advisory_or_error_and_settles_the_next(
    fleet: Fleet, backstop: Backstop
) -> None:
    boom = await create(fleet, S.QUEUED)
    boom_seq = await put_for(fleet, boom.run_id)
    deep_seq = await put(fleet, DEEP)
    huge_seq = await put(fleet, b'{"v": 1, "attempt": ' + HUGE + b"}")
    healthy = await create(fleet, S.QUEUED)
    healthy_seq = await put_for(fleet, healthy.run_id)

    subject = fleet.names.advisory_subject
    advisories = [
        DEEP,
        b'{"stream_seq": ' + DEEP + b"}",
        b'{"stream_seq": ' + HUGE + b"}",
        b'{"stream_seq": 1' + b"0" * 30 + b"}",
        b'{"stream_seq": 2.5}',
        json.dumps({"stream_seq": deep_seq}).encode(),
        json.dumps({"stream_seq": huge_seq}).encode(),
        json.dumps({"stream_seq": boom_seq}).encode(),  # settle raises RuntimeError
        json.dumps({"stream_seq": healthy_seq}).encode(),  # must still be settled
    ]
    for data in advisories:
        await fleet.js.publish(subject, data, stream=fleet.names.advisory_stream)

    flaky = rebuilt(backstop, store=FailingStore(fleet.store, boom.run_id))

    async def healthy_parked() -> RunDocument | None:
        doc = await fleet.store.get_run(healthy.run_id)
        return doc if doc.status is S.FAILED_RESUMABLE else None

    async with looping(flaky) as task:
        parked = await eventually(healthy_parked, within=20)
        assert not task.done()  # the loop is alive

        async def all_acked() -> bool:
            info = await fleet.js.consumer_info(
                fleet.names.advisory_stream, fleet.names.backstop_consumer
            )
            return bool(info.num_pending == 0 and info.num_ack_pending == 0)

        await eventually(all_acked, within=10)
        assert not task.done()
    assert parked.failure_code == "DLQ_PARKED"
    for seq in (deep_seq, huge_seq):
        rec = await record(fleet, seq)
        assert rec is not None and (rec.reason, rec.replayable) == ("malformed", False)
        assert not await present(fleet, seq)
    rec = await record(fleet, boom_seq)
    assert rec is not None
    assert (rec.reason, rec.run_id, rec.attempt) == ("internal_error", boom.run_id, 1)
    assert "RuntimeError" in rec.detail
    assert not await present(fleet, boom_seq)
    # The run itself was not judged: it is left as it was (the sweeper parks it, §5.9).
    assert await fleet.store.get_run(boom.run_id) == boom


class Advisory:
    """An advisory message: records its disposition."""

    def __init__(self, seq: int) -> None:
        self.data = json.dumps({"stream_seq": seq}).encode()
        self.disposed: list[str] = []

    async def ack_sync(self) -> None:
        self.disposed.append("ack")

    async def nak(self, delay: float) -> None:
        self.disposed.append(f"nak {delay}")


async def test_backstop_internal_error_it_cannot_record_naks_the_advisory_and_deletes_nothing(
    fleet: Fleet, backstop: Backstop
) -> None:
    run = await create(fleet, S.QUEUED)
    seq = await put_for(fleet, run.run_id)
    stuck = rebuilt(
        backstop, store=FailingStore(fleet.store, run.run_id), dlq=UnwritableDlq(fleet.dlq)
    )
    advisory = Advisory(seq)
    assert await stuck.settle_advisory(advisory) == "internal_error"  # type: ignore[arg-type]
    assert advisory.disposed == [f"nak {UNRECORDABLE_NAK}"]
    assert await present(fleet, seq)
    assert await record(fleet, seq) is None
    assert await fleet.store.get_run(run.run_id) == run


async def test_backstop_internal_error_keeps_an_existing_record(
    fleet: Fleet, backstop: Backstop
) -> None:
    run = await create(fleet, S.QUEUED)
    seq = await put_for(fleet, run.run_id)
    await fleet.dlq.put(
        seq=seq, body=b"", headers={}, reason="retries_exhausted", run_id=run.run_id, attempt=1
    )
    advisory = Advisory(seq)
    flaky = rebuilt(backstop, store=FailingStore(fleet.store, run.run_id))
    assert await flaky.settle_advisory(advisory) == "internal_error"  # type: ignore[arg-type]
    assert advisory.disposed == ["ack"]
    rec = await record(fleet, seq)
    assert rec is not None and rec.reason == "retries_exhausted"
    assert not await present(fleet, seq)
