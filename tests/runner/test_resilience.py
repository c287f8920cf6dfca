"""Findings of the soak and the fuzz, each pinned by a test named after its rule: the backstop
survives a message someone else removed and a NATS restart, never naks a forged future attempt
forever; the sweeper survives a NATS outage; a settled run's missing status event is repaired."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta

import nats.errors
import pytest

from engine.local import new_run_id
from runner.backstop import Backstop
from runner.sweeper import Sweeper
from store import RunStatus
from tests.runner.callables import body, bound_drain, idle_runner, new_run, publish_raw
from tests.runner.conftest import Fleet, eventually

S = RunStatus


@pytest.fixture(autouse=True)
async def _quick_drain(fleet: Fleet) -> AsyncIterator[None]:
    yield
    bound_drain(fleet.runners)


@pytest.fixture
async def backstop(fleet: Fleet) -> Backstop:
    runner = await idle_runner(fleet, owner="resilience-test")
    assert runner.svc is not None
    return Backstop(runner.svc)


async def test_backstop_delete_of_a_message_already_removed_is_not_an_error(
    fleet: Fleet, backstop: Backstop
) -> None:
    ack = await publish_raw(fleet.js, fleet.names.runs_subject, b"x")
    await fleet.js.delete_msg(fleet.names.runs_stream, ack.seq)  # a runner's last ack, say
    await backstop._delete(ack.seq)  # must not raise (nats-server answers 500/10057)


async def test_backstop_dead_letters_a_copy_still_ahead_of_its_run_after_max_deliver(
    fleet: Fleet, backstop: Backstop
) -> None:
    run = new_run("hello", run_id=new_run_id(), status=S.QUEUED)
    await fleet.store.create_run(run)
    ack = await publish_raw(
        fleet.js, fleet.names.runs_subject, body(run.run_id, 5), run_id=run.run_id, attempt=5
    )
    verdict, delay = await backstop.settle(ack.seq)
    assert (verdict, delay) == ("attempt_ahead", None)
    record = await fleet.dlq.get(ack.seq)
    assert record.reason == "attempt_ahead" and not record.replayable
    assert (await fleet.store.get_run(run.run_id)).version == run.version  # nothing written


async def test_backstop_advisory_is_nakd_not_fatal_when_nats_fails_mid_settle(
    fleet: Fleet, backstop: Backstop
) -> None:
    class Advisory:
        data = b'{"stream_seq": 1}'
        disposed: list[str] = []  # noqa: RUF012 - a recorder for this one test

        async def ack_sync(self) -> None:
            self.disposed.append("ack")

        async def nak(self, delay: float) -> None:
            self.disposed.append(f"nak {delay}")

    async def failing_settle(seq: int) -> tuple[str, float | None]:
        raise nats.errors.TimeoutError

    backstop.settle = failing_settle  # type: ignore[method-assign]
    advisory = Advisory()
    assert await backstop.settle_advisory(advisory) == "nats_error"  # type: ignore[arg-type]
    assert advisory.disposed == ["nak 5.0"]


async def test_sweeper_loop_skips_a_pass_when_nats_is_unavailable(fleet: Fleet) -> None:
    runner = await idle_runner(fleet, owner="sweeper-loop-test")
    assert runner.svc is not None
    sweeper = Sweeper(runner.svc)
    passes: list[str] = []

    async def flaky_pass(*, force: bool = False) -> None:
        passes.append("pass")
        if len(passes) == 1:
            raise nats.errors.TimeoutError
        raise asyncio.CancelledError  # end the loop after the second pass

    sweeper.sweep_once = flaky_pass  # type: ignore[method-assign,assignment]
    runner.svc.wire = runner.svc.wire.model_copy(
        update={"sweeper_interval": timedelta(seconds=0.01)}
    )
    with pytest.raises(asyncio.CancelledError):
        await sweeper.loop()
    assert passes == ["pass", "pass"]  # the NATS error did not end the loop


async def test_settled_run_missing_its_status_event_is_repaired_by_its_redelivery(
    fleet: Fleet,
) -> None:
    # A run whose runner was killed between the `finished` write and `run_finished`.
    run = new_run("hello", run_id=new_run_id(), status=S.FINISHED)
    await fleet.store.create_run(run)
    await fleet.store.append_event(run.run_id, "run_claimed", {"path": "fresh"}, attempt=1)
    await fleet.start_runner(sweeper=False, backstop=False)
    await publish_raw(
        fleet.js, fleet.names.runs_subject, body(run.run_id, 1), run_id=run.run_id, attempt=1
    )

    async def repaired() -> list[object] | None:
        events = await fleet.store.read_events(run.run_id)
        found = [e for e in events if e.type == "run_finished"]
        return found or None

    (event,) = await eventually(repaired)
    assert event.data == {"repaired": True} and event.attempt == 1
    assert await fleet.queue_drained()
    # A second copy finds the event and appends nothing more.
    await publish_raw(
        fleet.js, fleet.names.runs_subject, body(run.run_id, 1), run_id=run.run_id, attempt=1
    )
    assert await fleet.queue_drained()
    finished = [e for e in await fleet.store.read_events(run.run_id) if e.type == "run_finished"]
    assert len(finished) == 1


async def test_status_no_execution_reached_is_not_repaired(fleet: Fleet) -> None:
    # A resume whose publish was reported failed flipped the run back to paused at the new
    # attempt; a copy that landed anyway must not invent a `run_paused` for that attempt.
    run = new_run("hello", run_id=new_run_id(), status=S.PAUSED_OPERATOR, attempt=2)
    await fleet.store.create_run(run)
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    await publish_raw(
        fleet.js, fleet.names.runs_subject, body(run.run_id, 2), run_id=run.run_id, attempt=2
    )
    assert await fleet.queue_drained()

    async def acked() -> bool:
        return (
            runner.metrics.deliveries.labels(disposition="ack", reason="settled")._value.get() >= 1
        )

    assert await eventually(acked)
    assert [e.type for e in await fleet.store.read_events(run.run_id)] == []
