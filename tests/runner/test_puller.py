"""`runner.puller.Puller` against a real nats-server: a lone message is handed over when it
arrives (not when the pull expires), a backlog in batches, and nothing is ever dropped
(ADR-0015)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig

from runner.puller import Puller, PullRefused
from tests.runner.conftest import eventually
from tests.support.nats_server import NatsServer

LONG = 30.0
"""A pull's expiry far longer than any wait below: a fetch that returned only at its expiry
fails the test's `wait_for` instead of passing slowly."""


@dataclass
class Queue:
    nc: Client
    js: JetStreamContext
    stream: str
    subject: str
    consumer: str

    def puller(self) -> Puller:
        return Puller(self.nc, self.stream, self.consumer)

    async def waiting(self) -> int:
        info = await self.js.consumer_info(self.stream, self.consumer)
        return info.num_waiting or 0


@pytest.fixture
async def queue(nats_server: NatsServer, nats_prefix: str) -> AsyncIterator[Queue]:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    stream, subject, consumer = f"{nats_prefix}_PULL", f"{nats_prefix}.pull", "workers"
    await js.add_stream(
        StreamConfig(name=stream, subjects=[subject], retention=RetentionPolicy.WORK_QUEUE)
    )
    await js.add_consumer(
        stream, ConsumerConfig(durable_name=consumer, ack_policy=AckPolicy.EXPLICIT)
    )
    try:
        yield Queue(nc, js, stream, subject, consumer)
    finally:
        await js.delete_stream(stream)
        await nc.close()


async def test_a_lone_message_is_handed_over_when_it_arrives_not_when_the_pull_expires(
    queue: Queue,
) -> None:
    puller = await queue.puller().subscribe()
    fetch = asyncio.ensure_future(puller.fetch(16, LONG))
    await eventually(queue.waiting, within=10)  # the request waits at the server
    await queue.js.publish(queue.subject, b"lone")
    msgs = await asyncio.wait_for(fetch, 10)
    assert [m.data for m in msgs] == [b"lone"]
    assert msgs[0].metadata.sequence.stream == 1  # a JetStream delivery: it can be acked
    await msgs[0].ack_sync()
    await puller.unsubscribe()


async def test_a_backlog_comes_in_batches_of_at_most_the_free_slots(queue: Queue) -> None:
    for i in range(5):
        await queue.js.publish(queue.subject, f"m{i}".encode())
    puller = await queue.puller().subscribe()
    first = await asyncio.wait_for(puller.fetch(3, LONG), 10)
    second = await asyncio.wait_for(puller.fetch(3, LONG), 10)
    assert [m.data for m in first] == [b"m0", b"m1", b"m2"]
    assert [m.data for m in second] == [b"m3", b"m4"]
    for msg in first + second:
        await msg.ack_sync()
    await puller.unsubscribe()


async def test_a_pull_that_finds_nothing_returns_no_message_at_its_expiry(queue: Queue) -> None:
    puller = await queue.puller().subscribe()
    assert await asyncio.wait_for(puller.fetch(4, 0.3), 10) == []
    assert await eventually(lambda: _none_waiting(queue), within=10)  # the request is over
    await puller.unsubscribe()


async def _none_waiting(queue: Queue) -> bool:
    return await queue.waiting() == 0


async def test_the_closing_status_of_an_earlier_request_leaves_no_pull_waiting_for_a_batch(
    queue: Queue,
) -> None:
    """A request given up on (its client-side wait ended first) is closed by the server
    later, and that `408` lands in a later pull. nats-py's `fetch` took it for its own, sent a
    plain lingering request, and the next lone message went to that one and waited out its
    expiry for a batch (`docs/performance.md`, "The fetch's tail"). Here the late status names
    the old request's reply subject: it ends nothing and starts nothing, and every lone
    message after it is handed over at once."""
    puller = await queue.puller().subscribe()
    for word in (b"first", b"second", b"third"):
        fetch = asyncio.ensure_future(puller.fetch(16, LONG))
        await eventually(queue.waiting, within=10)  # the request waits at the server
        await queue.nc.publish(f"{puller.inbox}.0", b"", headers={"Status": "408"})
        await queue.js.publish(queue.subject, word)
        msgs = await asyncio.wait_for(fetch, 10)
        assert [m.data for m in msgs] == [word]
        await msgs[0].ack_sync()
    await puller.unsubscribe()


async def test_a_message_that_arrives_between_pulls_is_returned_by_the_next_one(
    queue: Queue,
) -> None:
    """Nothing is dropped: a delivery that answers a request given up earlier is a real one,
    and the next fetch hands it over before it asks for more."""
    puller = await queue.puller().subscribe()
    await queue.nc.publish(f"{puller.inbox}.7", b"stray")
    await queue.nc.flush()
    msgs = await eventually(lambda: puller.fetch(16, 0.2), within=10)
    assert [m.data for m in msgs] == [b"stray"]
    await puller.unsubscribe()


async def test_a_delivery_whose_own_headers_imitate_a_status_is_handed_over(
    queue: Queue,
) -> None:
    """Anyone may publish a header named `Status`: the message is still a delivery (it carries
    its ack subject), never a status to skip. Dropped, it would come back after every
    `ack_wait` and be dropped again, never acked, nak'd or recorded."""
    for headers in ({"Status": "404", "Description": "No Messages"}, {"Status": "408"}):
        await queue.js.publish(queue.subject, b"imitation", headers=headers)
    await queue.js.publish(queue.subject, b"plain")
    puller = await queue.puller().subscribe()
    msgs = await asyncio.wait_for(puller.fetch(16, LONG), 10)
    assert [m.data for m in msgs] == [b"imitation", b"imitation", b"plain"]
    assert all(m.reply.startswith("$JS.ACK.") for m in msgs)
    await puller.unsubscribe()


async def test_deliveries_of_a_given_up_request_left_at_unsubscribe_are_nakd_not_left(
    queue: Queue,
) -> None:
    """A delivery that answers a request given up just before the fetch loop stopped is never
    handed over. Nak'd at unsubscribe, it is redelivered at once; left alone, only after the
    consumer's `ack_wait` (30 s here)."""
    puller = await queue.puller().subscribe()
    ask = json.dumps({"batch": 1, "expires": int(LONG * 1e9)}).encode()
    subject = f"$JS.API.CONSUMER.MSG.NEXT.{queue.stream}.{queue.consumer}"
    await queue.nc.publish(subject, ask, reply=f"{puller.inbox}.99")  # a request given up
    await queue.js.publish(queue.subject, b"stray delivery")
    await eventually(lambda: _arrived(puller), within=10)
    await puller.unsubscribe()
    assert await puller.nak_strays(0.0) == 1
    again = queue.puller()
    msgs = await asyncio.wait_for(again.fetch(1, 5.0), 10)
    assert [m.data for m in msgs] == [b"stray delivery"]
    assert msgs[0].metadata.num_delivered == 2
    await again.unsubscribe()


async def _arrived(puller: Puller) -> bool:
    """The delivery reached the puller's callback (the server marking it pending is not
    enough: a message still in nats-py's queue at unsubscribe is dropped by the client)."""
    return bool(puller._arrived)


async def test_a_pull_jetstream_refuses_raises_a_typed_error(queue: Queue) -> None:
    puller = Puller(queue.nc, queue.stream, "no_such_consumer")
    with pytest.raises(PullRefused) as info:
        await asyncio.wait_for(puller.fetch(1, 1.0), 10)
    assert info.value.code == "pull_refused"
    await puller.unsubscribe()


async def test_a_pull_asks_for_at_least_one_message(queue: Queue) -> None:
    with pytest.raises(ValueError, match="at least one"):
        await queue.puller().fetch(0, 1.0)
