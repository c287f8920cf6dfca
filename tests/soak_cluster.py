"""The cluster soak's server faults (`python -m tests.soak --nats-cluster 3 --server-faults N`).

Each fault hits one node of the local JetStream cluster (`tests.support.nats_cluster.Cluster`)
and ends with the cluster whole again — every node restarted or resumed and current, the runs
stream, its work consumer and the backstop consumer each with a leader — before the soak's next
fault, so faults never pile up into a loss of quorum (which is not what this soak tests):

- `kill_random`: SIGKILL of a node chosen at random (often a follower of everything).
- `kill_stream_leader`: SIGKILL of the node leading the runs stream (`--leader-kills`).
- `kill_consumer_leader`: SIGKILL of the node leading the work consumer.
- `stepdown_stream`, `stepdown_consumer`: the leader asked to step down through the JetStream
  API (`$JS.API.STREAM.LEADER.STEPDOWN.<stream>`, `$JS.API.CONSUMER.LEADER.STEPDOWN.<stream>.
  <consumer>`): an orderly hand-over, what a rolling upgrade does to every leader.
- `pause`: SIGSTOP of the node leading the work consumer for `pause_s` (longer than `ack_wait`),
  and at least until the others have elected a leader, then SIGCONT. Unlike a kill, its sockets
  stay open: clients connected to it see no error, their requests just go unanswered until it
  wakes (nats-py notices a dead server only after two unanswered pings, minutes by default).

A killed node is restarted after `outage_s` (same ports, same store) and waited for until its
`/healthz` is ok. What is measured per fault: how long the runs stream or its consumer had no
live leader (`broker_wait_s`: nothing could be published, acked or delivered) — observed from a
client of its own connected only to the live nodes, never the soak's client, which may be
connected to the very node that is paused.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client

from tests.support.nats_cluster import Cluster, leader_other_than

KINDS = (
    "kill_random",
    "kill_stream_leader",
    "kill_consumer_leader",
    "stepdown_stream",
    "stepdown_consumer",
    "pause",
)
_STEPDOWN_TRIES = 20
_STEPDOWN_PAUSE_S = 0.25
_WHOLE_WITHIN_S = 60.0
_POLL_S = 0.1


@dataclass
class ServerFault:
    kind: str
    node: str
    """The node hit (for a step-down, the leader that stepped down)."""
    broker_wait_s: float = 0.0
    """From the fault until the runs stream and its work consumer had a live leader again."""
    took_s: float = 0.0
    """From the fault until the cluster was whole again."""


class ClusterFaults:
    """The server faults of one soak, and what they measured (`faults`)."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        stream: str,
        consumer: str,
        backstop: tuple[str, str],
        outage_s: float,
        pause_s: float,
        rng: random.Random,
        say: Callable[[str], None],
    ) -> None:
        self.cluster = cluster
        self.stream = stream
        self.consumer = consumer
        self.backstop = backstop
        """(advisory stream, backstop consumer): checked whole after every fault."""
        self.outage_s = outage_s
        self.pause_s = pause_s
        self.rng = rng
        self.say = say
        self.faults: list[ServerFault] = []

    def plan(self, count: int) -> list[str]:
        """`count` kinds, every kind in turn from a seeded start, so a short plan still mixes."""
        start = self.rng.randrange(len(KINDS))
        return [KINDS[(start + i) % len(KINDS)] for i in range(count)]

    @property
    def max_broker_wait_s(self) -> float:
        return max((f.broker_wait_s for f in self.faults), default=0.0)

    def counts(self) -> dict[str, int]:
        return {kind: sum(1 for f in self.faults if f.kind == kind) for kind in KINDS}

    async def run(self, kind: str) -> ServerFault:
        started = time.monotonic()
        if kind.startswith("stepdown_"):
            fault = await self._step_down(kind)
        else:
            fault = await self._kill_or_pause(kind)
        await self.whole()
        fault.took_s = time.monotonic() - started
        self.faults.append(fault)
        self.say(
            f"nats: {kind} of {fault.node} over: no live leader for {fault.broker_wait_s:.1f}s,"
            f" whole again after {fault.took_s:.1f}s"
        )
        return fault

    async def _kill_or_pause(self, kind: str) -> ServerFault:
        if kind == "kill_random":
            index = self.rng.randrange(len(self.cluster.nodes))
        elif kind == "kill_stream_leader":
            index = await self.cluster.leader_of(self.stream)
        else:  # kill_consumer_leader, pause
            index = await self.cluster.leader_of(self.stream, self.consumer)
        name = self.cluster.name(index)
        fault = ServerFault(kind, name)
        started = time.monotonic()
        try:
            if kind == "pause":
                await asyncio.to_thread(self.cluster.pause, index)
                self.say(f"nats: SIGSTOP of {name} (the work consumer's leader)")
                length = self.pause_s
            else:
                await asyncio.to_thread(self.cluster.kill, index)
                self.say(f"nats: {kind}: SIGKILL of {name}")
                length = self.outage_s
            fault.broker_wait_s = await self._live_leaders(exclude=name, since=started)
            rest = length - (time.monotonic() - started)
            await asyncio.sleep(max(0.0, rest))  # the fault's length, on purpose
        finally:
            if kind == "pause":
                await asyncio.to_thread(self.cluster.resume, index)
                await asyncio.to_thread(self.cluster.wait_ready, [index])
            else:
                await asyncio.to_thread(self.cluster.restart, index)
        return fault

    async def _step_down(self, kind: str) -> ServerFault:
        consumer = self.consumer if kind == "stepdown_consumer" else None
        subject = (
            f"$JS.API.STREAM.LEADER.STEPDOWN.{self.stream}"
            if consumer is None
            else f"$JS.API.CONSUMER.LEADER.STEPDOWN.{self.stream}.{consumer}"
        )
        async with self.cluster.client() as (nc, _):
            old = await leader_other_than(nc, self.stream, consumer, exclude=None)
            started = time.monotonic()
            await _ask(nc, subject)
            self.say(f"nats: {kind}: {old} asked to step down")
            await leader_other_than(nc, self.stream, consumer, exclude=old)
            wait = time.monotonic() - started
        return ServerFault(kind, old, broker_wait_s=wait)

    async def _live_leaders(self, *, exclude: str, since: float) -> float:
        """Seconds from `since` until the runs stream and its consumer are led by a node other
        than `exclude` (at once when it led neither)."""
        async with self.cluster.client() as (nc, _):
            for consumer in (None, self.consumer):
                await leader_other_than(nc, self.stream, consumer, exclude=exclude)
        return time.monotonic() - since

    async def whole(self) -> None:
        """Every node ready in one sweep, and the runs stream, the work consumer, the advisory
        stream and the backstop consumer each with a leader. One sweep: a node's `/healthz`
        can turn unhealthy again while a restarted peer catches up ("stream ... is not current:
        group node unhealthy", seen on a node that was ok a moment before), so each node's ok in
        turn is not yet a whole cluster."""
        deadline = time.monotonic() + _WHOLE_WITHIN_S
        nodes = range(len(self.cluster.nodes))
        while not all(status == "ok" for status in await asyncio.to_thread(self._health, nodes)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not whole within {_WHOLE_WITHIN_S}s")
            await asyncio.sleep(_POLL_S)  # between two sweeps, not a synchronisation
        advisory, backstop = self.backstop
        async with self.cluster.client() as (nc, _):
            for stream, consumer in (
                (self.stream, None),
                (self.stream, self.consumer),
                (advisory, None),
                (advisory, backstop),
            ):
                await leader_other_than(nc, stream, consumer, exclude=None)

    def _health(self, nodes: range) -> list[str]:
        return [self.cluster.health(k) for k in nodes]


async def _ask(nc: Client, subject: str) -> None:
    """A step-down request, asked again while the API is electing (503) or not answering: a
    request lost in an election is not the fault under test."""
    last: object = None
    for _ in range(_STEPDOWN_TRIES):
        try:
            reply = json.loads((await nc.request(subject, b"", timeout=2)).data)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            last = exc
        else:
            if reply.get("success"):
                return
            last = reply.get("error")
        await asyncio.sleep(_STEPDOWN_PAUSE_S)  # between two asks, not a synchronisation
    raise RuntimeError(f"{subject}: no step-down after {_STEPDOWN_TRIES} asks (last: {last})")
