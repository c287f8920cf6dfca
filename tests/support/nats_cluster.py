"""A three-node JetStream cluster for tests: the product's `runner.localcluster` (random free
ports, a temp store per node, readiness by each node's `/healthz`, clean stop) plus what only
tests do to a cluster — find a stream's or consumer's leader and make it step down through the
JetStream API, kill, pause and restart a node.

Leadership is read and changed through a short-lived client of its own (connected to every live
node), so a test's own connection is never the one that watches it. Import the fixture into a
test module (`from tests.support.nats_cluster import nats_cluster`): it is module-scoped, one
cluster per module, since forming one costs about a second and a half of the CI budget.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from runner.localcluster import NatsCluster

__all__ = ["Cluster", "NatsCluster", "leader_other_than", "nats_cluster"]

_LEADER_WAIT_S = 30.0
_POLL_S = 0.05
_INFO_TIMEOUT_S = 0.2


class Cluster(NatsCluster):
    """The product's cluster with the tests' leadership operations (async: they talk NATS)."""

    @asynccontextmanager
    async def client(self) -> AsyncIterator[tuple[Client, JetStreamContext]]:
        live = [n.url for n in self.nodes if n.running and not n.paused]
        nc = await nats.connect(servers=live, connect_timeout=2, max_reconnect_attempts=5)
        try:
            yield nc, nc.jetstream()
        finally:
            await nc.close()

    async def leader_of(self, stream: str, consumer: str | None = None) -> int:
        """The index of the node leading `stream` (or its `consumer`), once there is one."""
        async with self.client() as (nc, _):
            return self.index_of(await leader_other_than(nc, stream, consumer, exclude=None))

    async def step_down(self, stream: str, consumer: str | None = None) -> tuple[int, int]:
        """Ask the leader of `stream` (or of its `consumer`) to step down; return (old, new)
        once another node leads — the new leader is then answering, which is what a test
        wants before it goes on."""
        subject = (
            f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}"
            if consumer is None
            else f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}"
        )
        async with self.client() as (nc, _):
            old = await leader_other_than(nc, stream, consumer, exclude=None)
            reply = await nc.request(subject, b"", timeout=5)
            assert b'"success":true' in reply.data, reply.data
            new = await leader_other_than(nc, stream, consumer, exclude=old)
        return self.index_of(old), self.index_of(new)

    async def kill_leader_of(self, stream: str, consumer: str | None = None) -> int:
        """SIGKILL the node leading `stream` (or its consumer); the caller restarts it."""
        index = await self.leader_of(stream, consumer)
        self.kill(index)
        return index


async def leader_other_than(
    nc: Client, stream: str, consumer: str | None, *, exclude: str | None
) -> str:
    """Poll the stream's (or consumer's) info until it names a leader other than `exclude`.

    During an election nobody answers a consumer's info (it is the leader's to answer) or the
    API answers 503: both are waited out with a short request timeout, so the poll sees the new
    leader within ~0.2 s of its election (nats-py's 5 s default would hide it that long)."""
    subject = (
        f"$JS.API.STREAM.INFO.{stream}"
        if consumer is None
        else f"$JS.API.CONSUMER.INFO.{stream}.{consumer}"
    )
    deadline = time.monotonic() + _LEADER_WAIT_S
    seen: str | None = None
    while True:
        try:
            reply = json.loads((await nc.request(subject, b"", timeout=_INFO_TIMEOUT_S)).data)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            reply = {}
        error = reply.get("error")
        if error and error.get("code") != 503:
            raise RuntimeError(f"{subject}: {error}")
        seen = (reply.get("cluster") or {}).get("leader")
        if seen and seen != exclude:
            return str(seen)
        if time.monotonic() > deadline:
            what = stream if consumer is None else f"{stream}/{consumer}"
            raise TimeoutError(f"{what}: no leader other than {exclude} (last seen {seen})")
        await asyncio.sleep(_POLL_S)  # the pause between two polls, not a synchronisation


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three JetStream servers in one cluster, ready (meta leader elected) when yielded.

    A test that kills, stops or pauses a node must restart (or resume) it in a `finally`,
    so the next test of the module finds all three.
    """
    cluster = Cluster(tmp_path_factory.mktemp("nats-cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
