"""The broker double (`tests/model/broker.py`) against a real nats-server: the same contract
tests run on both, for every behaviour the protocol model relies on. Passing here is what
justifies running the model on the double.

On the real server time passes for real (ack_wait 1 s, short nak delays) and every wait is a
fetch with a timeout or a poll with a deadline; on the double the same waits move its clock.

The real-server cases run twice: on one nats-server, and on a three-node cluster with the stream
replicated three times (SPEC §3, §11: production's R3), where `broker.disrupt()` — a no-op
elsewhere — makes the stream's leader and then the consumer's leader step down through the
JetStream API in the middle of the behaviour each test pins. Every test passing on all three is
the statement that a leader change does not change what the model relies on; where the cluster
differs, the test says so (and the double would have to learn it).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal, Protocol

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    PubAck,
    RawStreamMsg,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError, ServerError, ServiceUnavailableError

from publisher.queue_snapshot import QueueSnapshot, queue_snapshot
from tests.model.broker import MSG_ID, Clock, Delivered, StreamInfoApi, WorkQueue
from tests.support.nats_cluster import Cluster, leader_other_than, nats_cluster
from tests.support.nats_server import NatsServer

__all__ = ["nats_cluster"]  # the module-scoped cluster fixture, imported for the cluster cases

ACK_WAIT = 1.0
MAX_DELIVER = 3
WINDOW = 1.0
TOL = 0.15
"""Real timers fire a little early or late; the double is exact."""


Leaders = Literal["stream", "consumer", "both"]


class Delivery(Protocol):
    seq: int
    num_delivered: int
    data: bytes

    async def ack(self) -> None: ...
    async def nak(self, delay: float | None = None) -> None: ...
    async def in_progress(self) -> None: ...


class Broker(Protocol):
    async def publish(self, data: bytes, msg_id: str | None = None) -> PubAck: ...
    async def fetch(self, batch: int = 1, wait: float = 0.25) -> list[Delivery]: ...
    async def get_msg(self, seq: int) -> RawStreamMsg: ...
    async def delete_msg(self, seq: int) -> bool: ...
    async def snapshot(self) -> QueueSnapshot: ...
    async def wait(self, seconds: float) -> None: ...
    async def disrupt(self, leaders: Leaders = "both") -> None: ...
    @property
    def removal_lag(self) -> float: ...
    def now(self) -> float: ...
    def advisories(self) -> list[int]: ...


# -- the double --------------------------------------------------------------------------------


class _DoubleDelivery:
    def __init__(self, d: Delivered) -> None:
        self._d = d
        self.seq = d.seq
        self.num_delivered = d.num_delivered
        self.data = d.data

    async def ack(self) -> None:
        self._d.ack()

    async def nak(self, delay: float | None = None) -> None:
        self._d.nak(delay)

    async def in_progress(self) -> None:
        self._d.in_progress()


class DoubleBroker:
    """The double with a blocking fetch in virtual time: waiting moves the clock."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.queue = WorkQueue(
            self.clock, ack_wait=ACK_WAIT, max_deliver=MAX_DELIVER, duplicate_window=WINDOW
        )

    async def publish(self, data: bytes, msg_id: str | None = None) -> PubAck:
        return self.queue.publish("work", data, {MSG_ID: msg_id} if msg_id else None)

    async def fetch(self, batch: int = 1, wait: float = 0.25) -> list[Delivery]:
        deadline = self.clock.now + wait
        while True:
            got = self.queue.fetch(batch)
            if got:
                return [_DoubleDelivery(d) for d in got]
            due = self.queue.next_due()
            if due is None or due > deadline:
                self.clock.now = max(self.clock.now, deadline)
                self.queue.deliverable()
                return []
            self.clock.now = max(self.clock.now, due)

    async def get_msg(self, seq: int) -> RawStreamMsg:
        return self.queue.get_msg(seq)

    async def snapshot(self) -> QueueSnapshot:
        return await queue_snapshot(StreamInfoApi(self.queue), self.queue.stream)

    async def delete_msg(self, seq: int) -> bool:
        return self.queue.delete_msg(seq)

    async def wait(self, seconds: float) -> None:
        self.clock.advance(seconds)

    async def disrupt(self, leaders: Leaders = "both") -> None:
        """Where the cluster's leaders step down: the double's consumer does what a clustered
        consumer does when its leader changes (`WorkQueue.consumer_leader_change`)."""
        if leaders in ("consumer", "both"):
            self.queue.consumer_leader_change()

    @property
    def removal_lag(self) -> float:
        return 0.0  # an ack removes at once

    def now(self) -> float:
        return self.clock.now

    def advisories(self) -> list[int]:
        return [a.stream_seq for a in self.queue.advisories]


# -- the real server ---------------------------------------------------------------------------


class _NatsDelivery:
    def __init__(self, msg: Msg, nc: Client) -> None:
        self._msg = msg
        self._nc = nc
        self.seq = msg.metadata.sequence.stream
        self.num_delivered = msg.metadata.num_delivered
        self.data = msg.data

    async def ack(self) -> None:
        await self._msg.ack_sync()

    async def nak(self, delay: float | None = None) -> None:
        await self._msg.nak(delay=delay)
        await self._nc.flush()

    async def in_progress(self) -> None:
        await self._msg.in_progress()
        await self._nc.flush()


class NatsBroker:
    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        stream: str,
        subject: str,
        cluster: Cluster | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.stream = stream
        self.subject = subject
        self.cluster = cluster
        self.stepdowns: list[tuple[str, int, int]] = []
        self.psub: JetStreamContext.PullSubscription | None = None
        self._advisories: list[int] = []

    async def setup(self) -> None:
        await self.js.add_stream(
            StreamConfig(
                name=self.stream,
                subjects=[self.subject],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                duplicate_window=WINDOW,
                num_replicas=1 if self.cluster is None else 3,
            )
        )
        await self.js.add_consumer(
            self.stream,
            ConsumerConfig(
                durable_name="runners",
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=ACK_WAIT,
                max_deliver=MAX_DELIVER,
                max_ack_pending=-1,
                filter_subject=self.subject,
            ),
        )

        async def advisory(msg: Msg) -> None:
            self._advisories.append(int(json.loads(msg.data)["stream_seq"]))

        await self.nc.subscribe(
            f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.stream}.runners", cb=advisory
        )
        self.psub = await self.js.pull_subscribe_bind("runners", stream=self.stream)
        if self.cluster is not None:
            # A replicated stream and consumer answer only once their raft groups have elected:
            # a pull before that gets a 503 (seen in CI on a loaded machine), which no test here
            # means to pin. The runner waits the same way (`leaderless`, `runner.embedded`).
            async with self.cluster.client() as (watcher, _):
                await leader_other_than(watcher, self.stream, None, exclude=None)
                await leader_other_than(watcher, self.stream, "runners", exclude=None)

    async def publish(self, data: bytes, msg_id: str | None = None) -> PubAck:
        return await self.js.publish(
            self.subject, data, headers={MSG_ID: msg_id} if msg_id else None
        )

    async def fetch(self, batch: int = 1, wait: float = 0.25) -> list[Delivery]:
        assert self.psub is not None
        try:
            msgs = await self.psub.fetch(batch, timeout=wait)
        except (nats.errors.TimeoutError, TimeoutError):
            return []
        except ServiceUnavailableError:
            # A pull during an election is refused with a 503; the runner's puller raises
            # `PullRefused` for it and its loop pulls again (runner/runner.py): so does this.
            return []
        return [_NatsDelivery(m, self.nc) for m in msgs]

    async def get_msg(self, seq: int) -> RawStreamMsg:
        return await self.js.get_msg(self.stream, seq)

    async def snapshot(self) -> QueueSnapshot:
        return await queue_snapshot(self.nc, self.stream)

    async def delete_msg(self, seq: int) -> bool:
        return await self.js.delete_msg(self.stream, seq)

    async def wait(self, seconds: float) -> None:
        await asyncio.sleep(seconds)  # the pause between two polls, never a synchronisation

    @property
    def removal_lag(self) -> float:
        """One server removes an acked message before it answers the ack; the cluster does it
        a few ms later (see `gone`)."""
        return 0.0 if self.cluster is None else 1.0

    async def disrupt(self, leaders: Leaders = "both") -> None:
        """On the cluster: the stream's leader steps down, then the consumer's (or only one
        of them); each returns once another node leads. On one server: nothing."""
        if self.cluster is None:
            return
        if leaders in ("stream", "both"):
            old, new = await self.cluster.step_down(self.stream)
            self.stepdowns.append(("stream", old, new))
        if leaders in ("consumer", "both"):
            old, new = await self.cluster.step_down(self.stream, "runners")
            self.stepdowns.append(("consumer", old, new))

    def now(self) -> float:
        return time.monotonic()

    def advisories(self) -> list[int]:
        return list(self._advisories)


@pytest.fixture(params=["double", "nats", pytest.param("cluster", marks=pytest.mark.cluster)])
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    if request.param == "double":
        yield DoubleBroker()
        return
    cluster: Cluster | None = None
    if request.param == "cluster":
        cluster = request.getfixturevalue("nats_cluster")
        servers = cluster.urls
    else:
        server: NatsServer = request.getfixturevalue("nats_server")
        servers = [server.url]
    prefix = f"t{uuid.uuid4().hex[:16]}"
    nc = await nats.connect(servers=servers)
    try:
        real = NatsBroker(nc, nc.jetstream(), f"{prefix}_RUNS", f"{prefix}.runs", cluster)
        await real.setup()
        yield real
        if cluster is not None:  # every cluster case did step leaders down where it says so
            assert real.stepdowns, "a cluster case that never disrupted proves nothing extra"
        await real.js.delete_stream(real.stream)
    finally:
        await nc.close()


# -- helpers -----------------------------------------------------------------------------------


async def next_delivery(broker: Broker, within: float) -> Delivery:
    """The next delivery, polled with a deadline in the broker's own time."""
    deadline = broker.now() + within
    while broker.now() < deadline:
        got = await broker.fetch(1, wait=min(0.25, max(deadline - broker.now(), 0.01)))
        if got:
            return got[0]
    raise AssertionError(f"nothing delivered within {within}s")


async def nothing_delivered(broker: Broker, within: float) -> None:
    deadline = broker.now() + within
    while broker.now() < deadline:
        got = await broker.fetch(1, wait=min(0.25, max(deadline - broker.now(), 0.01)))
        assert got == [], f"unexpected delivery seq={got[0].seq} n={got[0].num_delivered}"


async def gone(broker: Broker, seq: int) -> bool:
    """Whether `get_msg(seq)` finds nothing, allowing for the broker's `removal_lag`: on the
    cluster an acked work-queue message is removed through the stream's own raft group after
    the consumer has answered the ack, so it stays readable for a few ms (2-26 ms measured)."""
    deadline = broker.now() + broker.removal_lag
    while True:
        try:
            await broker.get_msg(seq)
        except NotFoundError:
            return True
        if broker.now() >= deadline:
            return False
        await broker.wait(0.01)


async def exhaust(broker: Broker, seq: int) -> Delivery:
    """Deliver `seq` up to its last delivery (quick naks in between); return the last one."""
    for n in range(1, MAX_DELIVER):
        d = await next_delivery(broker, 2.0)
        assert (d.seq, d.num_delivered) == (seq, n)
        await d.nak(0.05)
    last = await next_delivery(broker, 2.0)
    assert (last.seq, last.num_delivered) == (seq, MAX_DELIVER)
    return last


async def advisory_for(broker: Broker, seq: int, within: float) -> list[int]:
    """Pull (the server notices max-delivered messages when it looks for work) until the
    advisory arrives."""
    deadline = broker.now() + within
    while seq not in broker.advisories():
        assert broker.now() < deadline, f"no MAX_DELIVERIES advisory for {seq} in {within}s"
        assert await broker.fetch(1, wait=0.2) == []
    return broker.advisories()


# -- publishing --------------------------------------------------------------------------------


async def test_publish_assigns_consecutive_sequences_readable_by_get_msg(broker: Broker) -> None:
    acks = [await broker.publish(f"m{i}".encode(), f"id-{i}") for i in range(2)]
    await broker.disrupt()
    acks.append(await broker.publish(b"m2", "id-2"))
    first = acks[0].seq
    assert [a.seq for a in acks] == [first, first + 1, first + 2]
    assert not any(a.duplicate for a in acks)
    for i, a in enumerate(acks):
        msg = await broker.get_msg(a.seq)
        assert msg.data == f"m{i}".encode()
        assert (msg.headers or {}).get(MSG_ID) == f"id-{i}"


async def test_a_msg_id_within_the_window_is_a_duplicate_of_the_original(broker: Broker) -> None:
    a = await broker.publish(b"one", "x")
    await broker.disrupt("stream")  # the new stream leader must know the id the old one stored
    b = await broker.publish(b"two", "x")
    c = await broker.publish(b"three", "y")
    assert b.duplicate is True and b.seq == a.seq
    assert (await broker.get_msg(a.seq)).data == b"one"
    assert c.seq == a.seq + 1 and not c.duplicate  # the duplicate stored nothing


async def test_dedupe_outlives_the_message_it_names(broker: Broker) -> None:
    a = await broker.publish(b"one", "x")
    d = await next_delivery(broker, 1.0)
    await d.ack()
    assert await gone(broker, a.seq)
    await broker.disrupt()  # a leader that never held the message must still know its id
    again = await broker.publish(b"one", "x")
    assert again.duplicate is True and again.seq == a.seq
    assert await gone(broker, a.seq)


async def test_a_msg_id_is_new_again_after_the_window(broker: Broker) -> None:
    t0 = broker.now()
    a = await broker.publish(b"one", "x")
    await broker.disrupt("stream")
    deadline = t0 + 4 * WINDOW
    while True:
        ack = await broker.publish(b"again", "x")
        if not ack.duplicate:
            break
        assert broker.now() < deadline, "the msg id still dedupes long after the window"
        await broker.wait(0.05)
    assert broker.now() - t0 >= WINDOW - TOL
    assert ack.seq == a.seq + 1


# -- the consumer ------------------------------------------------------------------------------


async def test_fetch_hands_out_messages_in_order_as_first_deliveries(broker: Broker) -> None:
    acks = [await broker.publish(f"m{i}".encode(), f"id-{i}") for i in range(3)]
    await broker.disrupt()
    two = await broker.fetch(2, wait=1.0)
    one = await broker.fetch(2, wait=0.3)
    assert [(d.seq, d.num_delivered) for d in two + one] == [(a.seq, 1) for a in acks]
    assert [d.data for d in two + one] == [b"m0", b"m1", b"m2"]


async def test_ack_removes_the_message_for_good(broker: Broker) -> None:
    a = await broker.publish(b"one", "x")
    d = await next_delivery(broker, 1.0)
    await broker.disrupt()  # the ack goes to leaders that did not hand out the delivery
    await d.ack()
    assert await gone(broker, a.seq)
    await nothing_delivered(broker, 2 * ACK_WAIT)


async def test_an_unacked_delivery_is_redelivered_after_ack_wait(broker: Broker) -> None:
    a = await broker.publish(b"one", "x")
    first = await next_delivery(broker, 1.0)
    t0 = broker.now()
    await broker.disrupt()
    again = await next_delivery(broker, 3 * ACK_WAIT)
    assert broker.now() - t0 >= ACK_WAIT - TOL
    assert (first.seq, first.num_delivered) == (a.seq, 1)
    assert (again.seq, again.num_delivered, again.data) == (a.seq, 2, b"one")


async def test_a_consumer_leader_change_redelivers_at_once_a_redelivery_not_working_acked(
    broker: Broker,
) -> None:
    """Where the cluster differs (nats-server 2.15.1, measured): the consumer's replicated
    state keeps the ack_wait clock of a message's first delivery or of its last working ack,
    not of a later redelivery. So when the consumer's leader changes, a message redelivered
    less than ack_wait ago and not working-acked since is handed out again at once, to a second
    holder. On one server (and in the double) it waits out ack_wait. A first delivery, or a
    redelivery followed by a working ack, keeps its clock (the tests above and below pass on
    the cluster with a step-down in their middle). For runfleet this is one more duplicate
    delivery, answered by the fence (SPEC §13 inv. 2); the runner's first working ack after
    its claim closes the window. The double models it (`WorkQueue.consumer_leader_change`,
    called by its `disrupt`), so the model's broker answers as the cluster does."""
    a = await broker.publish(b"one", "x")
    await next_delivery(broker, 1.0)
    second = await next_delivery(broker, 3 * ACK_WAIT)
    t0 = broker.now()
    await broker.disrupt("consumer")
    third = await next_delivery(broker, 3 * ACK_WAIT)
    elapsed = broker.now() - t0
    assert (second.num_delivered, third.seq, third.num_delivered) == (2, a.seq, 3)
    if isinstance(broker, NatsBroker) and broker.cluster is None:
        assert elapsed >= ACK_WAIT - TOL  # one server has no leader to change
    else:
        assert elapsed < ACK_WAIT - TOL  # early: before the second holder's ack_wait


@pytest.mark.parametrize("delay", [0.3, 1.6])
async def test_nak_with_a_delay_redelivers_after_that_delay(broker: Broker, delay: float) -> None:
    a = await broker.publish(b"one", "x")
    d = await next_delivery(broker, 1.0)
    t0 = broker.now()
    await d.nak(delay)
    await broker.disrupt()
    again = await next_delivery(broker, delay + 2.0)
    elapsed = broker.now() - t0
    assert elapsed >= delay - TOL  # not before the delay, even when it is longer than ack_wait
    assert elapsed < delay + ACK_WAIT
    assert (again.seq, again.num_delivered) == (a.seq, 2)


async def test_nak_without_a_delay_redelivers_at_once(broker: Broker) -> None:
    a = await broker.publish(b"one", "x")
    d = await next_delivery(broker, 1.0)
    await broker.disrupt()
    t0 = broker.now()
    await d.nak()
    again = await next_delivery(broker, ACK_WAIT)
    assert broker.now() - t0 < ACK_WAIT / 2
    assert (again.seq, again.num_delivered) == (a.seq, 2)


async def test_in_progress_restarts_ack_wait(broker: Broker) -> None:
    await broker.publish(b"one", "x")
    d = await next_delivery(broker, 1.0)
    last_beat = broker.now()
    for beat in range(5):  # 2 s of working acks: twice ack_wait without a redelivery
        assert await broker.fetch(1, wait=0.4) == []
        await d.in_progress()
        last_beat = broker.now()
        if beat == 1:
            await broker.disrupt()
    again = await next_delivery(broker, 3 * ACK_WAIT)
    assert broker.now() - last_beat >= ACK_WAIT - TOL
    assert again.num_delivered == 2


async def test_an_old_delivery_ack_removes_the_message_a_later_one_holds(broker: Broker) -> None:
    a = await broker.publish(b"one", "x")
    old = await next_delivery(broker, 1.0)
    new = await next_delivery(broker, 3 * ACK_WAIT)
    assert new.num_delivered == 2
    await broker.disrupt()
    await old.ack()
    assert await gone(broker, a.seq)
    await nothing_delivered(broker, 2 * ACK_WAIT)


async def test_an_old_delivery_nak_redelivers_the_message_a_later_one_holds(
    broker: Broker,
) -> None:
    a = await broker.publish(b"one", "x")
    old = await next_delivery(broker, 1.0)
    await next_delivery(broker, 3 * ACK_WAIT)
    await broker.disrupt()
    t0 = broker.now()
    await old.nak(0.2)
    third = await next_delivery(broker, ACK_WAIT)
    assert broker.now() - t0 < ACK_WAIT - TOL  # the nak's delay, not the holder's ack_wait
    assert (third.seq, third.num_delivered) == (a.seq, 3)


async def test_an_old_delivery_working_ack_extends_the_later_one(broker: Broker) -> None:
    await broker.publish(b"one", "x")
    old = await next_delivery(broker, 1.0)
    await next_delivery(broker, 3 * ACK_WAIT)
    for beat in range(5):
        await old.in_progress()
        if beat == 0:  # after a working ack: see the next test for a leader change before one
            await broker.disrupt()
        assert await broker.fetch(1, wait=0.4) == []


@pytest.mark.parametrize("ending", ["ack_wait", "nak"])
async def test_after_max_deliver_the_message_stays_and_one_advisory_names_it(
    broker: Broker, ending: str
) -> None:
    a = await broker.publish(b"one", "x")
    last = await exhaust(broker, a.seq)
    await broker.disrupt()  # the advisory comes from a consumer leader that did not deliver
    if ending == "nak":
        await last.nak(0.2)
    await nothing_delivered(broker, 2 * ACK_WAIT)
    assert await advisory_for(broker, a.seq, 3 * ACK_WAIT) == [a.seq]
    assert (await broker.get_msg(a.seq)).data == b"one"  # work-queue retention keeps it
    await nothing_delivered(broker, ACK_WAIT)
    assert broker.advisories() == [a.seq]


async def test_an_ack_after_max_deliver_still_removes_the_message(broker: Broker) -> None:
    a = await broker.publish(b"one", "x")
    last = await exhaust(broker, a.seq)
    await advisory_for(broker, a.seq, 4 * ACK_WAIT)
    await broker.disrupt()
    await last.ack()
    assert await gone(broker, a.seq)


# -- the stream by sequence --------------------------------------------------------------------


async def test_get_msg_and_delete_msg_by_sequence(broker: Broker) -> None:
    a = await broker.publish(b"one", "x")
    b = await broker.publish(b"two", "y")
    await broker.disrupt()
    assert await broker.delete_msg(a.seq) is True
    with pytest.raises(NotFoundError) as read:
        await broker.get_msg(a.seq)
    assert read.value.err_code == 10037
    with pytest.raises(ServerError) as delete:  # not NotFoundError: callers must catch this
        await broker.delete_msg(a.seq)
    assert delete.value.err_code == 10057
    with pytest.raises(NotFoundError):
        await broker.get_msg(b.seq + 10)
    only = await next_delivery(broker, 1.0)
    assert (only.seq, only.data) == (b.seq, b"two")


async def test_a_queue_snapshot_knows_which_sequences_are_gone_as_get_msg_does(
    broker: Broker,
) -> None:
    """The sweeper's one look per pass (issue 19): the stream info's `first_seq`, `last_seq`
    and deleted list answer, for every sequence, what `get_msg` would."""
    a, b, c, d = [await broker.publish(data, data.decode()) for data in (b"a", b"b", b"c", b"d")]
    await broker.delete_msg(b.seq)  # interior deletions: the list
    first = await next_delivery(broker, 1.0)
    assert first.seq == a.seq
    await broker.disrupt()
    second = await next_delivery(broker, 1.0)
    await second.ack()  # c acked: gone too
    assert second.seq == c.seq
    assert await gone(broker, c.seq)
    snap = await broker.snapshot()
    assert [snap.gone(s.seq) for s in (a, b, c, d)] == [False, True, True, False]
    assert snap.gone(d.seq + 1) is None  # published after the snapshot, for all it knows
    await first.ack()  # the head goes: first_seq moves past it
    assert await gone(broker, a.seq)
    snap = await broker.snapshot()
    assert [snap.gone(s.seq) for s in (a, b, c, d)] == [True, True, True, False]


async def test_a_message_deleted_while_delivered_is_not_redelivered(broker: Broker) -> None:
    a = await broker.publish(b"one", "x")
    d = await next_delivery(broker, 1.0)
    await broker.delete_msg(a.seq)
    await broker.disrupt()
    await nothing_delivered(broker, 2 * ACK_WAIT)
    await d.ack()  # harmless
    assert await gone(broker, a.seq)


async def test_a_delivery_is_acked_or_nakd_once(broker: Broker) -> None:
    await broker.publish(b"one", "x")
    d = await next_delivery(broker, 1.0)
    await d.nak(0.2)
    await broker.disrupt()
    with pytest.raises(nats.errors.MsgAlreadyAckdError):
        await d.ack()
