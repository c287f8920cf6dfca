"""What the runners' consumer reports as lag, the signal KEDA scales on (SPEC §11; issue 16
item 3; docs/deploy.md "What the lag counts").

KEDA's `nats-jetstream` scaler reads the consumer's `num_pending + num_ack_pending` from
`/jsz` (its `getMaxMsgLag`). Against a real nats-server and a real runner:

- a run paused for a human is acked (SPEC §5.6): it leaves the consumer, no lag;
- a run parked in the DLQ (a transient failure at the last delivery) is acked after its record
  is written: no lag;
- a call that raises `Transient("SANDBOX_CAPACITY")` with deliveries left is nakked with the
  table's 5-minute delay (SPEC §5.5, §6.6): the message stays delivered-but-unacked for those
  5 minutes, so it counts in `num_ack_pending` and KEDA adds a runner per `lagThreshold` of
  them, although no runner is busy with it. That is the point: a run that cannot get a sandbox
  keeps asking for capacity until it gets one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from store import RunDocument, RunStatus
from tests.runner.callables import bound_drain, open_fleet, workflow
from tests.runner.conftest import Fleet, eventually
from tests.support.nats_server import NatsServer

S = RunStatus
APPROVAL = Path(__file__).resolve().parents[2] / "examples" / "approval.yaml"
CAPACITY_DELAY_S = 300.0  # SPEC §5.5: SANDBOX_CAPACITY naks with 5 min


@pytest.fixture
async def fleet2(tmp_path: Path, nats_server: NatsServer) -> AsyncIterator[Fleet]:
    """A fleet whose consumer delivers a message at most twice (a quick road to the DLQ) and
    one runner (no sweeper, no backstop: nothing but the deliveries moves the consumer)."""
    async with open_fleet(tmp_path / "fleet", nats_server, max_deliver=2) as fleet:
        await fleet.start_runner(sweeper=False, backstop=False)
        yield fleet
        bound_drain(fleet.runners)


async def lag(fleet: Fleet) -> tuple[int, int]:
    """(num_pending, num_ack_pending) of the runners' consumer, as /jsz reports them."""
    info = await fleet.js.consumer_info(fleet.names.runs_stream, fleet.names.consumer)
    return int(info.num_pending or 0), int(info.num_ack_pending or 0)


async def lag_settles_at(fleet: Fleet, expected: tuple[int, int]) -> None:
    """Poll until the consumer reports `expected` (an ack is fire-and-forget)."""

    async def probe() -> bool:
        return await lag(fleet) == expected

    try:
        await eventually(probe, within=10)
    except AssertionError:
        raise AssertionError(f"lag {await lag(fleet)}, expected {expected}") from None


async def launch_flaky(fleet: Fleet, tmp_path: Path, code: str) -> RunDocument:
    gates = tmp_path / "gates"
    gates.mkdir(exist_ok=True)
    return await fleet.launch(workflow("flaky").source, {"dir": str(gates), "code": code})


async def retries(fleet: Fleet, run_id: str) -> list[dict[str, object]]:
    return [
        dict(e.data)
        for e in await fleet.store.read_events(run_id)
        if e.type == "run_retry_scheduled"
    ]


async def test_a_run_paused_for_a_human_adds_no_lag(fleet2: Fleet) -> None:
    run = await fleet2.launch(APPROVAL.read_text())
    await fleet2.wait_status(run.run_id, "paused_waiting_human")
    await lag_settles_at(fleet2, (0, 0))
    assert (await fleet2.store.get_run(run.run_id)).status is S.PAUSED_WAITING_HUMAN


async def test_a_run_parked_in_the_dlq_adds_no_lag(fleet2: Fleet, tmp_path: Path) -> None:
    run = await launch_flaky(fleet2, tmp_path, "SANDBOX_LOST")

    async def parked() -> bool:
        return (await fleet2.store.get_run(run.run_id)).failure_code == "DLQ_PARKED"

    await eventually(parked)
    await lag_settles_at(fleet2, (0, 0))
    seq = run.publication.stream_seq if run.publication else 0
    assert (await fleet2.dlq.get(seq)).run_id == run.run_id


async def test_a_sandbox_capacity_nak_is_lag_while_it_waits_out_its_delay(
    fleet2: Fleet, tmp_path: Path
) -> None:
    run = await launch_flaky(fleet2, tmp_path, "SANDBOX_CAPACITY")

    async def nakked() -> list[dict[str, object]]:
        return await retries(fleet2, run.run_id)

    assert await eventually(nakked) == [
        {"code": "SANDBOX_CAPACITY", "delay": CAPACITY_DELAY_S, "delivery": 1}
    ]
    doc = await fleet2.store.get_run(run.run_id)
    assert (doc.status, doc.failure_code) == (S.FAILED_RESUMABLE, "SANDBOX_CAPACITY")
    # Delivered, not acked, not redelivered for 5 minutes: counted in num_ack_pending, which
    # KEDA adds to num_pending. No runner holds it (the lease is released, the slot free).
    await lag_settles_at(fleet2, (0, 1))
    assert (await fleet2.store.get_run(run.run_id)).lease is None
    (runner,) = fleet2.runners
    assert runner.svc is not None and not runner.svc.executions


async def test_only_the_capacity_nak_counts_when_all_three_wait_at_once(
    fleet2: Fleet, tmp_path: Path
) -> None:
    """The three side by side on one consumer: KEDA's lag is 1, the capacity nak."""
    human = await fleet2.launch(APPROVAL.read_text())
    parked = await launch_flaky(fleet2, tmp_path, "SANDBOX_LOST")
    waiting = await launch_flaky(fleet2, tmp_path, "SANDBOX_CAPACITY")

    async def all_three() -> bool:
        docs = [await fleet2.store.get_run(r.run_id) for r in (human, parked, waiting)]
        return (
            docs[0].status is S.PAUSED_WAITING_HUMAN
            and docs[1].failure_code == "DLQ_PARKED"
            and docs[2].failure_code == "SANDBOX_CAPACITY"
        )

    await eventually(all_three)
    await lag_settles_at(fleet2, (0, 1))
    num_pending, num_ack_pending = await lag(fleet2)
    assert num_pending + num_ack_pending == 1  # what KEDA compares with lagThreshold
