"""SPEC §5.4: every ack on a last delivery is `ack_sync`; SPEC §5.6: a drain handoff ends
with `ack_sync` of the old delivery.

Only `ack_sync` is confirmed by the server. A lost plain ack on a last delivery leaves the
message to the MAX_DELIVERIES advisory (the backstop then judges a run that was already
settled); a lost ack after a handoff leaves the old attempt's message to be redelivered. The
audit replaced both with plain acks and no test noticed, since a plain ack usually lands.

The runner gets real JetStream messages; each is wrapped, as the runner receives it, in a spy
that records which of its methods the runner called and passes every call on to the real
message, so the broker sees exactly what it would have.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg

from runner.deliveries import Delivery
from tests.runner.callables import bound_drain, calls, entered, workflow
from tests.runner.conftest import Fleet, eventually

Calls = dict[tuple[int, int], list[str]]
"""(stream sequence, delivery number) → the disposition methods called on that delivery."""


class SpyMsg:
    """A real `Msg`, recording `ack`, `ack_sync`, `nak` and `term` before passing them on."""

    def __init__(self, msg: Msg, record: list[str]) -> None:
        self._msg = msg
        self._record = record

    async def ack(self) -> None:
        self._record.append("ack")
        await self._msg.ack()

    async def ack_sync(self, **kwargs: Any) -> Msg:
        self._record.append("ack_sync")
        return await self._msg.ack_sync(**kwargs)

    async def nak(self, delay: float | None = None) -> None:
        self._record.append("nak")
        await self._msg.nak(delay=delay)

    async def term(self) -> None:
        self._record.append("term")
        await self._msg.term()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._msg, name)


@pytest.fixture
def dispositions(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """Every delivery a runner takes from here on gets a spied message."""
    seen: Calls = defaultdict(list)
    real = Delivery.from_msg

    def spied(msg: Msg, max_deliver: int) -> Delivery:
        delivery = real(msg, max_deliver)
        key = (delivery.info.stream_seq, delivery.info.num_delivered)
        delivery.msg = SpyMsg(msg, seen[key])  # type: ignore[assignment]
        return delivery

    monkeypatch.setattr(Delivery, "from_msg", staticmethod(spied))
    return seen


async def test_spec_5_4_every_ack_on_a_last_delivery_is_ack_sync(
    two_deliveries: Fleet, dispositions: Calls, gates: Path
) -> None:
    """A transient failure naks the first delivery; the second (the last) auto-retries the
    run to `finished` and is acked — confirmed."""
    fleet = two_deliveries
    await fleet.start_runner(sweeper=False, backstop=False)
    run = await fleet.publisher.launch(
        workflow("flaky"), {"dir": str(gates), "failures": 1}, tenant="default"
    )

    await fleet.wait_status(run.run_id, "finished")
    assert calls(gates, run.run_id) == [1, 1]  # both executions of attempt 1
    assert run.publication is not None and run.publication.stream_seq is not None
    seq = run.publication.stream_seq

    async def settled() -> list[str]:
        return dispositions.get((seq, 2), [])

    await eventually(settled)
    assert dispositions[(seq, 1)] == ["nak"]
    assert dispositions[(seq, 2)] == ["ack_sync"]


async def test_spec_5_6_a_drain_handoff_ends_with_ack_sync_of_the_old_delivery(
    fleet: Fleet, dispositions: Calls, gates: Path
) -> None:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    run = await fleet.publisher.launch(workflow("hold"), {"dir": str(gates)}, tenant="default")
    assert run.publication is not None and run.publication.stream_seq is not None
    seq = run.publication.stream_seq

    async def holding() -> bool:
        return entered(gates, run.run_id) == [1]

    await eventually(holding)
    bound_drain([runner])
    await runner.shutdown()  # SIGTERM's drain: the running execution hands off

    handed = await fleet.store.get_run(run.run_id)
    assert (handed.attempt, handed.failure_code) == (2, "RUNNER_INTERRUPTED")
    assert handed.publication is not None and handed.publication.stream_seq != seq
    # The first (not the last) delivery of attempt 1: its plain ack would not be confirmed.
    assert dispositions[(seq, 1)] == ["ack_sync"]
