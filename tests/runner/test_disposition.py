"""Disposition (SPEC §5.1, §5.4 order, §5.6 table): every outcome of `run()` maps to one status
write and one of ack / nak(delay) / DLQ, on a live runner."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from nats.js.errors import NotFoundError

from engine.local import new_run_id
from engine.resume import ResumeRequest
from publisher.dlq import DlqRecord, DlqStore
from publisher.errors import RecordNotFound
from runner.runner import Runner
from runner.sweeper import Sweeper
from store import (
    CasConflict,
    Condition,
    RunDocument,
    RunStatus,
    StoreUnavailable,
    Update,
)
from store.sqlite import SqliteRunStore
from tests.runner.callables import bound_drain, calls, open_fleet, workflow
from tests.runner.conftest import Fleet, deliveries, eventually, reaches
from tests.support.nats_server import NatsServer

S = RunStatus


@pytest.fixture(autouse=True)
async def _quick_drain(fleet: Fleet) -> AsyncIterator[None]:
    yield
    bound_drain(fleet.runners)


@pytest.fixture
async def small_fleet(tmp_path: Path, nats_server: NatsServer) -> AsyncIterator[Fleet]:
    """A fleet whose consumer delivers each message at most twice."""
    async with open_fleet(tmp_path / "small", nats_server, max_deliver=2) as fleet:
        yield fleet


async def gone(fleet: Fleet, seq: int) -> bool:
    try:
        await fleet.js.get_msg(fleet.names.runs_stream, seq)
    except NotFoundError:
        return True
    return False


async def wait_record(fleet: Fleet, seq: int) -> DlqRecord:
    async def probe() -> DlqRecord | None:
        try:
            return await fleet.dlq.get(seq)
        except RecordNotFound:
            return None

    return await eventually(probe, within=10)


async def launch_flaky(fleet: Fleet, gates: Path, **vars_: Any) -> RunDocument:
    return await fleet.launch(workflow("flaky").source, {"dir": str(gates), **vars_})


async def events_of(fleet: Fleet, run_id: str, type_: str) -> list[Any]:
    return [e for e in await fleet.store.read_events(run_id) if e.type == type_]


# -- transient, deliveries left -------------------------------------------------------------------


async def test_transient_code_with_deliveries_left_is_failed_resumable_and_nakd_with_the_tables_delay(  # noqa: E501
    fleet: Fleet, gates: Path
) -> None:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    run = await launch_flaky(fleet, gates, failures=2, code="SANDBOX_LOST")
    done = await fleet.wait_status(run.run_id, "finished", "failed", within=15)
    assert done.status is S.FINISHED
    scheduled = await events_of(fleet, run.run_id, "run_retry_scheduled")
    # RUNFLEET_TRANSIENT_DELAY (0.2 s here) doubling per delivery (SPEC §5.5).
    assert [e.data for e in scheduled] == [
        {"code": "SANDBOX_LOST", "delay": 0.2, "delivery": 1},
        {"code": "SANDBOX_LOST", "delay": 0.4, "delivery": 2},
    ]
    claims = await events_of(fleet, run.run_id, "run_claimed")
    assert [e.data["path"] for e in claims] == ["fresh", "auto_retry", "auto_retry"]
    # Each redelivery came after its nak's delay, not at once (a plain nak() would).
    for nak, claim in zip(scheduled, claims[1:], strict=True):
        assert (claim.at - nak.at).total_seconds() >= nak.data["delay"] - 0.002
    assert calls(gates, run.run_id) == [1, 1, 1]  # one attempt, three deliveries
    assert deliveries(runner, "nak", "transient") == 2
    assert done.failure_code is None and done.attempt == 1
    assert await fleet.queue_drained()


async def test_transient_code_with_a_fixed_delay_waits_it_out_failed_resumable(
    fleet: Fleet, gates: Path
) -> None:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    run = await launch_flaky(fleet, gates, failures=1, code="SANDBOX_CAPACITY")

    async def scheduled() -> list[Any]:
        return await events_of(fleet, run.run_id, "run_retry_scheduled")

    [event] = await eventually(scheduled)
    assert event.data == {"code": "SANDBOX_CAPACITY", "delay": 300.0, "delivery": 1}
    await reaches(runner, "nak", "transient")
    doc = await fleet.store.get_run(run.run_id)
    assert (doc.status, doc.failure_code) == (S.FAILED_RESUMABLE, "SANDBOX_CAPACITY")
    assert doc.lease is None  # released before the nak
    assert await fleet.stream_messages() == 1  # nak'd, waiting out its delay; not termed
    info = await fleet.js.consumer_info(fleet.names.runs_stream, fleet.names.consumer)
    assert info.num_ack_pending == 1


# -- acked failures -------------------------------------------------------------------------------


async def test_deterministic_code_is_acked_failed_with_exactly_one_retry_skipped(
    fleet: Fleet, gates: Path
) -> None:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    run = await launch_flaky(fleet, gates, code="TOOL_FAILED_PERMANENT", permanent=True)
    done = await fleet.wait_status(run.run_id, "failed", "failed_resumable")
    assert (done.status, done.failure_code) == (S.FAILED, "TOOL_FAILED_PERMANENT")
    skipped = await events_of(fleet, run.run_id, "run_retry_skipped")
    assert [e.data for e in skipped] == [
        {"reason": "deterministic", "code": "TOOL_FAILED_PERMANENT"}
    ]
    assert await events_of(fleet, run.run_id, "run_retry_scheduled") == []
    await reaches(runner, "ack", "failed")
    assert await fleet.queue_drained()
    assert calls(gates, run.run_id) == [1]


@pytest.mark.parametrize(
    ("name", "status"),
    [("deliberate", S.FAILED), ("deliberate_resumable", S.FAILED_RESUMABLE)],
)
async def test_deliberate_failure_is_acked_with_retry_skipped_deliberate(
    fleet: Fleet, name: str, status: RunStatus
) -> None:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    run = await fleet.launch(workflow(name).source)
    done = await fleet.wait_status(run.run_id, "failed", "failed_resumable")
    assert (done.status, done.failure_code) == (status, "BOT_REFUSED")
    await reaches(runner, "ack", str(status))  # the disposal follows the events
    skipped = await events_of(fleet, run.run_id, "run_retry_skipped")
    assert [e.data for e in skipped] == [{"reason": "deliberate", "code": "BOT_REFUSED"}]
    assert await fleet.queue_drained()
    assert len(await events_of(fleet, run.run_id, "run_claimed")) == 1  # never auto-retried


# -- transient at the last delivery ---------------------------------------------------------------


class WatchedStore:
    """The real store; at the park (`failure_code: DLQ_PARKED`) it notes whether the DLQ
    record of the run's delivery already exists."""

    def __init__(self, inner: SqliteRunStore, fleet: Fleet) -> None:
        self.inner = inner
        self.fleet = fleet
        self.record_before_park: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def update_run(
        self, run_id: str, conditions: list[Condition], update: Update, **kw: Any
    ) -> RunDocument | CasConflict:
        if update.set.get("failure_code") == "DLQ_PARKED":
            current = await self.inner.get_run(run_id)
            assert current.lease is not None and current.lease.stream_seq is not None
            try:
                await self.fleet.dlq.get(current.lease.stream_seq)
                self.record_before_park.append(True)
            except RecordNotFound:
                self.record_before_park.append(False)
        return await self.inner.update_run(run_id, conditions, update, **kw)


async def test_transient_code_at_the_last_delivery_is_dead_lettered_before_it_parks(
    small_fleet: Fleet, gates: Path
) -> None:
    fleet = small_fleet
    inner = fleet.store
    assert isinstance(inner, SqliteRunStore)
    watched = WatchedStore(inner, fleet)
    fleet.store = watched  # type: ignore[assignment]
    try:
        runner = await fleet.start_runner(sweeper=False, backstop=False)
    finally:
        fleet.store = inner
    run = await launch_flaky(fleet, gates, code="SANDBOX_LOST")
    seq = run.publication.stream_seq if run.publication else None
    assert seq is not None

    async def settled() -> bool:
        doc = await fleet.store.get_run(run.run_id)
        return doc.failure_code == "DLQ_PARKED"

    await eventually(settled)
    parked = await fleet.store.get_run(run.run_id)
    assert (parked.status, parked.failure_code, parked.cause_code) == (
        S.FAILED_RESUMABLE,
        "DLQ_PARKED",
        "SANDBOX_LOST",
    )
    assert watched.record_before_park == [True]
    record = await fleet.dlq.get(seq)
    assert record.id == seq
    assert (record.run_id, record.attempt, record.num_delivered) == (run.run_id, 1, 2)
    assert "SANDBOX_LOST" in record.detail
    assert json.loads(await fleet.dlq.body(record))["run_id"] == run.run_id
    [event] = await events_of(fleet, run.run_id, "run_dlq_parked")
    assert event.data["record_id"] == seq
    # One nak with the table's delay, then the record; the last delivery is acked.
    retries = await events_of(fleet, run.run_id, "run_retry_scheduled")
    assert [e.data["delivery"] for e in retries] == [1]
    await reaches(runner, "ack", "dlq_parked")

    async def message_gone() -> bool:
        return await gone(fleet, seq)

    await eventually(message_gone)
    assert calls(gates, run.run_id) == [1, 1]


async def test_a_last_delivery_whose_dlq_record_cannot_be_written_is_parked_without_it(
    small_fleet: Fleet, gates: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JetStream's disk is full: the DLQ record of the last delivery is refused, and so is the
    max-deliveries advisory the backstop would have parked the run from. The run was nak'd and
    left `running` with no lease for good (`resume`: "already running"; a disk-full drill).
    It is parked `DLQ_PARKED` with its code as the cause and a `run_dlq_unavailable` event,
    the delivery is acked, nothing retries it by itself (left auto-resumable, the sweeper
    republished it every cycle while the DLQ refused: a review), and `resume` brings it back."""
    fleet = small_fleet

    async def disk_full(*args: Any, **kwargs: Any) -> DlqRecord:
        raise nats.errors.TimeoutError  # what a publish to a full JetStream answers

    monkeypatch.setattr(DlqStore, "put", disk_full)
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    run = await launch_flaky(fleet, gates, code="SANDBOX_LOST", failures=2)
    seq = run.publication.stream_seq if run.publication else 0

    async def settled() -> RunDocument | None:
        doc = await fleet.store.get_run(run.run_id)
        return doc if doc.status is S.FAILED_RESUMABLE and doc.lease is None else None

    await reaches(runner, "ack", "dlq_unavailable")
    parked = await eventually(settled)
    assert (parked.failure_code, parked.cause_code, parked.attempt) == (
        "DLQ_PARKED",
        "SANDBOX_LOST",
        1,
    )
    [event] = await events_of(fleet, run.run_id, "run_dlq_unavailable")
    assert event.data["code"] == "SANDBOX_LOST"
    assert await eventually(lambda: gone(fleet, seq))
    # Past several lease intervals (1 s here), when an auto-resumable run whose message is
    # gone would be republished, the sweeper leaves a parked one alone.
    assert runner.svc is not None
    sweeper = Sweeper(runner.svc)
    until = time.monotonic() + 3 * 1.0
    while time.monotonic() < until:
        await sweeper.sweep_once(force=True)
        after = await fleet.store.get_run(run.run_id)
        assert (after.failure_code, after.attempt, after.publication) == (
            "DLQ_PARKED",
            1,
            parked.publication,
        )
        await asyncio.sleep(0.2)  # the window the sweeper is watched over, not a sync
    assert calls(gates, run.run_id) == [1, 1]

    await fleet.publisher.resume(run.run_id, ResumeRequest(), tenant="default")
    finished = await fleet.wait_status(run.run_id, "finished")
    assert finished.attempt == 2


async def test_dead_letter_body_over_256_kib_goes_to_the_blob_store(fleet: Fleet) -> None:
    await fleet.start_runner(sweeper=False, backstop=False)
    raw = b"\x00not json" + b"x" * (300 * 1024)
    ack = await fleet.js.publish(fleet.names.runs_subject, raw)
    record = await wait_record(fleet, ack.seq)
    assert record.reason == "malformed"
    assert record.body_b64 is None
    assert record.body_key == f"dlq/{ack.seq}.bin"
    assert record.body_bytes == len(raw)
    assert await fleet.blobs.get_bytes(record.body_key) == raw
    assert await fleet.dlq.body(record) == raw


# -- errors without a lease -----------------------------------------------------------------------


class FailingReads:
    """The real store, whose `get_run` of one run raises an unexpected error `times` times."""

    def __init__(self, inner: SqliteRunStore, run_id: str, times: int, error: Exception) -> None:
        self.inner = inner
        self.run_id = run_id
        self.times = times
        self.error = error

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get_run(self, run_id: str) -> RunDocument:
        if run_id == self.run_id and self.times > 0:
            self.times -= 1
            raise self.error
        return await self.inner.get_run(run_id)


def start_with(fleet: Fleet, store: Any) -> Any:
    inner = fleet.store
    fleet.store = store

    async def start() -> Runner:
        try:
            return await fleet.start_runner(sweeper=False, backstop=False)
        finally:
            fleet.store = inner

    return start()


async def test_unexpected_error_during_admission_is_nakd_and_dead_lettered_internal_error_at_the_last_delivery(  # noqa: E501
    small_fleet: Fleet,
) -> None:
    fleet = small_fleet
    run = await fleet.launch(workflow("hello").source)
    assert isinstance(fleet.store, SqliteRunStore)
    boom = FailingReads(fleet.store, run.run_id, times=99, error=RuntimeError("boom"))
    runner = await start_with(fleet, boom)
    seq = run.publication.stream_seq if run.publication else 0
    record = await wait_record(fleet, seq)
    assert (record.reason, record.num_delivered) == ("internal_error", 2)
    assert "boom" in record.detail
    assert json.loads(await fleet.dlq.body(record))["run_id"] == run.run_id
    assert deliveries(runner, "nak", "internal_error") == 1
    await reaches(runner, "dlq", "internal_error")
    assert await gone(fleet, seq)
    assert (await fleet.store.get_run(run.run_id)).status is S.QUEUED  # nothing written


async def test_internal_error_record_of_a_decodable_message_names_its_run_and_is_replayable(
    small_fleet: Fleet,
) -> None:
    fleet = small_fleet
    run = await fleet.launch(workflow("hello").source)
    assert isinstance(fleet.store, SqliteRunStore)
    await start_with(fleet, FailingReads(fleet.store, run.run_id, 99, RuntimeError("boom")))
    record = await wait_record(fleet, run.publication.stream_seq if run.publication else 0)
    assert (record.run_id, record.attempt, record.replayable) == (run.run_id, 1, True)


async def test_unexpected_error_during_admission_is_nakd_and_the_redelivery_runs(
    fleet: Fleet,
) -> None:
    run_id = new_run_id()
    assert isinstance(fleet.store, SqliteRunStore)
    boom = FailingReads(fleet.store, run_id, times=1, error=RuntimeError("boom"))
    runner = await start_with(fleet, boom)
    run = await fleet.publisher.launch(workflow("hello"), {}, tenant="default", run_id=run_id)
    await fleet.wait_status(run.run_id, "finished")
    assert deliveries(runner, "nak", "internal_error") == 1


async def test_jetstream_not_answering_is_a_warning_and_a_nak_not_an_unexpected_error(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/reliability.md C5: "no responders" while a consumer elects is news, not a bug: the
    delivery is nak'd `nats_unanswered` at warning, and the redelivery runs."""
    run_id = new_run_id()
    assert isinstance(fleet.store, SqliteRunStore)
    electing = FailingReads(fleet.store, run_id, times=1, error=nats.errors.NoRespondersError())
    runner = await start_with(fleet, electing)
    run = await fleet.publisher.launch(workflow("hello"), {}, tenant="default", run_id=run_id)
    await fleet.wait_status(run.run_id, "finished")
    assert deliveries(runner, "nak", "nats_unanswered") == 1
    assert deliveries(runner, "nak", "internal_error") == 0
    said = [r for r in caplog.records if r.name == "runner.delivery"]
    assert [r.levelname for r in said if "did not answer" in r.getMessage()] == ["WARNING"]
    assert not [r for r in said if r.levelno >= logging.ERROR]


async def test_store_unreachable_at_admission_is_nakd_with_the_transient_delay(
    fleet: Fleet,
) -> None:
    run = await fleet.launch(workflow("hello").source)
    assert isinstance(fleet.store, SqliteRunStore)
    down = FailingReads(fleet.store, run.run_id, times=2, error=StoreUnavailable("down"))
    runner = await start_with(fleet, down)
    await fleet.wait_status(run.run_id, "finished")
    assert deliveries(runner, "nak", "store_unreachable") == 2


class FailingStatusWrite:
    """The real store, unreachable once: at the execution's `finished` status write."""

    def __init__(self, inner: SqliteRunStore) -> None:
        self.inner = inner
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def update_run(
        self, run_id: str, conditions: list[Condition], update: Update, **kw: Any
    ) -> RunDocument | CasConflict:
        if update.set.get("status") == S.FINISHED and not self.failed:
            self.failed += 1
            raise StoreUnavailable("the store is down for a moment")
        return await self.inner.update_run(run_id, conditions, update, **kw)


async def test_store_unreachable_at_the_status_write_is_nakd_never_termed(
    fleet: Fleet, gates: Path
) -> None:
    assert isinstance(fleet.store, SqliteRunStore)
    flaky_store = FailingStatusWrite(fleet.store)
    runner = await start_with(fleet, flaky_store)
    run = await launch_flaky(fleet, gates, failures=0)
    done = await fleet.wait_status(run.run_id, "finished", within=15)
    assert flaky_store.failed == 1
    assert deliveries(runner, "nak", "store_unreachable") == 1
    claims = await events_of(fleet, run.run_id, "run_claimed")
    assert [e.data["path"] for e in claims] == ["fresh", "adoption"]  # redelivered, not termed
    assert done.lease is None
    assert await fleet.queue_drained()


async def test_adoption_after_the_final_checkpoint_does_not_rerun_completed_nodes(
    fleet: Fleet, gates: Path
) -> None:
    assert isinstance(fleet.store, SqliteRunStore)
    await start_with(fleet, FailingStatusWrite(fleet.store))
    run = await launch_flaky(fleet, gates, failures=0)
    await fleet.wait_status(run.run_id, "finished", within=15)
    assert calls(gates, run.run_id) == [1]
