"""Confirmed acks (`ack_sync`) as they go on the wire, on the paths
`test_ack_sync_dispositions.py` does not take:

- §5.4: every ack on a last delivery is `ack_sync`, here on an admission path (a superseded
  message), where `test_ack_sync_dispositions.py` covers an outcome's ack.
- §5.6: the drain's handoff whose CAS an operator beat ends with a plain release and `ack_sync`
  of the old delivery (the other branch of the table's drain row).

What went on the wire is read by a core subscriber on the stream's ack subjects: an `ack_sync`
is a request (its ack carries a reply inbox; the server confirms it), a plain `ack` is a
publish with no reply. Nothing sleeps to synchronise: waits poll with a deadline.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg

from engine.execution import Execution
from engine.local import new_run_id
from engine.outcome import Outcome
from runner.puller import Puller
from store import RunStatus
from tests.runner.callables import (
    body,
    bound_drain,
    entered,
    new_run,
    publish_raw,
    workflow,
)
from tests.runner.conftest import Fleet, eventually

# -- the wire -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AckFrame:
    """One disposition a client sent for a delivery, as the server received it."""

    stream_seq: int
    delivered: int
    verb: str
    """`+ACK` (an empty body is one), `-NAK`, `+WPI`, `+TERM`."""
    confirmed: bool
    """Sent as a request (`ack_sync`): the server answers it."""


def parse_ack(msg: Msg) -> AckFrame:
    """`$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` (or the form with
    a domain and an account hash before the stream: two more tokens up front)."""
    tokens = msg.subject.split(".")
    first = 4 if len(tokens) == 9 else 6
    # nats-py's `ack` and `ack_sync` both send an empty body, which JetStream takes as `+ACK`.
    verb = msg.data.split(b" ")[0].decode() if msg.data else "+ACK"
    return AckFrame(
        stream_seq=int(tokens[first + 1]),
        delivered=int(tokens[first]),
        verb=verb,
        confirmed=bool(msg.reply),
    )


@dataclass
class AckSpy:
    frames: list[AckFrame]

    def of(self, stream_seq: int, delivered: int) -> list[AckFrame]:
        return [f for f in self.frames if (f.stream_seq, f.delivered) == (stream_seq, delivered)]


@contextlib.asynccontextmanager
async def ack_spy(fleet: Fleet) -> AsyncIterator[AckSpy]:
    """Every disposition sent for the fleet's work stream from here on."""
    spy = AckSpy([])
    nc = await nats.connect(fleet.server.url)

    async def on_ack(msg: Msg) -> None:
        spy.frames.append(parse_ack(msg))

    await nc.subscribe(f"$JS.ACK.{fleet.names.runs_stream}.>", cb=on_ack)
    await nc.flush()
    try:
        yield spy
    finally:
        await nc.close()


# -- §5.4 -------------------------------------------------------------------------------------


async def test_spec_5_4_an_admission_ack_on_the_last_delivery_is_ack_sync(
    two_deliveries: Fleet,
) -> None:
    """§5.2 step 3: a superseded message is acked, nothing written. At its last delivery that
    ack is confirmed. The first delivery is taken off the runners' own consumer by the test and
    nak'd for immediate redelivery, so the runner's delivery is the last one, deterministically.
    """
    fleet = two_deliveries
    run_id = new_run_id()
    await fleet.store.create_run(
        new_run("hello", run_id=run_id, status=RunStatus.PAUSED_OPERATOR, attempt=2)
    )
    before = await fleet.store.get_run(run_id)
    async with ack_spy(fleet) as spy:
        pub = await publish_raw(
            fleet.js, fleet.names.runs_subject, body(run_id, 1), run_id=run_id, attempt=1
        )
        puller = await Puller(fleet.nc, fleet.names.runs_stream, fleet.names.consumer).subscribe()
        try:
            (first,) = await eventually(lambda: puller.fetch(1, 1.0), within=10)
            assert first.metadata.num_delivered == 1
            await first.nak()  # redelivered at once, as delivery 2 of 2
        finally:
            await puller.unsubscribe()

        await fleet.start_runner(sweeper=False, backstop=False)

        async def acked_last() -> list[AckFrame]:
            return [f for f in spy.of(pub.seq, 2) if f.verb == "+ACK"]

        (ack,) = await eventually(acked_last)

    assert ack.confirmed, "the ack of the last delivery was a plain, unconfirmed ack"
    assert [f.verb for f in spy.of(pub.seq, 1)] == ["-NAK"]
    after = await fleet.store.get_run(run_id)
    assert after.version == before.version  # superseded: nothing written
    assert await fleet.store.read_events(run_id) == []


# -- §5.6 -------------------------------------------------------------------------------------


async def test_spec_5_6_a_drain_handoff_an_operator_beat_is_a_plain_release_and_ack_sync(
    fleet: Fleet, gates: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain row of §5.6: "If the CAS fails (an operator acted), a plain release and
    `ack_sync`". The operator cancels the run between the drain's status write (1) and the
    handoff CAS (3), i.e. during the teardown (2): no new attempt, the lease released, and the
    old delivery — its first, not its last — acked with a confirmed ack."""
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    run = await fleet.publisher.launch(workflow("hold"), {"dir": str(gates)}, tenant="default")
    assert run.publication is not None and run.publication.stream_seq is not None
    seq = run.publication.stream_seq
    seen_by_operator: list[tuple[RunStatus, str | None]] = []
    real_teardown = Execution.teardown

    async def operator_cancels_during_teardown(
        self: Execution, outcome: Outcome | None = None
    ) -> None:
        if self.run_id == run.run_id:
            current = await fleet.store.get_run(run.run_id)
            seen_by_operator.append((current.status, current.failure_code))
            await fleet.publisher.cancel(run.run_id, tenant="default")
        await real_teardown(self, outcome)

    monkeypatch.setattr(Execution, "teardown", operator_cancels_during_teardown)

    async def holding() -> bool:
        return entered(gates, run.run_id) == [1]

    await eventually(holding)
    async with ack_spy(fleet) as spy:
        bound_drain([runner])
        await runner.shutdown()  # SIGTERM's drain

        async def acked() -> list[AckFrame]:
            return [f for f in spy.of(seq, 1) if f.verb == "+ACK"]

        (ack,) = await eventually(acked)

    assert seen_by_operator == [(RunStatus.FAILED_RESUMABLE, "RUNNER_INTERRUPTED")]
    after = await fleet.store.get_run(run.run_id)
    assert after.status is RunStatus.CANCELLED
    assert after.attempt == 1  # the CAS that bumps the attempt lost: no handoff
    assert after.lease is None  # the plain release
    assert after.publication is not None and after.publication.attempt == 1
    types = [e.type for e in await fleet.store.read_events(run.run_id)]
    assert "run_queued" not in types[types.index("run_claimed") :]
    assert ack.confirmed, "the old delivery was acked with a plain, unconfirmed ack"
