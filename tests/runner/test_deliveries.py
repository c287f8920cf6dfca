"""`runner.deliveries.Delivery` against a real nats-server: what goes on the wire for one
delivery, read by a core subscriber on the stream's ack subjects."""

from __future__ import annotations

import asyncio

import nats
from nats.aio.msg import Msg

from runner.deliveries import Delivery
from runner.puller import Puller
from tests.runner.conftest import Fleet, eventually


async def test_no_working_ack_follows_a_nak(fleet: Fleet) -> None:
    """The lease keeper's last beat can come after the disposition. A working ack sent after
    a nak makes JetStream wait `ack_wait` instead of the nak's delay, so none is sent."""
    spy = await nats.connect(fleet.server.url)
    seen: list[bytes] = []
    sentinel = asyncio.Event()

    async def on_ack(msg: Msg) -> None:
        seen.append(msg.data)

    async def on_sentinel(msg: Msg) -> None:
        sentinel.set()

    await spy.subscribe(f"$JS.ACK.{fleet.names.runs_stream}.>", cb=on_ack)
    await spy.subscribe(f"{fleet.names.namespace}.sentinel", cb=on_sentinel)
    await spy.flush()
    puller = await Puller(fleet.nc, fleet.names.runs_stream, fleet.names.consumer).subscribe()
    try:
        await fleet.js.publish(fleet.names.runs_subject, b"{}")
        msgs = await eventually(lambda: puller.fetch(1, 1.0), within=10)
        delivery = Delivery.from_msg(msgs[0], fleet.wire.max_deliver)
        await delivery.in_progress()  # still working: sent
        await delivery.nak(30.0)
        await delivery.in_progress()  # a beat after the disposition: not sent
        # Everything this connection sent before the sentinel reaches the spy before it.
        await fleet.nc.publish(f"{fleet.names.namespace}.sentinel", b"")
        await fleet.nc.flush()
        await asyncio.wait_for(sentinel.wait(), 10)
        assert [data.split(b" ")[0] for data in seen] == [b"+WPI", b"-NAK"]
        assert delivery.disposed == "nak"
    finally:
        await puller.unsubscribe()
        await spy.close()
