"""The cluster soak's server faults (`tests/soak_cluster.py`) on the tests' three-node cluster,
without a fleet: every kind hits the node it names (a leader for the kinds that say so), the
step-downs hand leadership to another node, and every fault ends with the cluster whole — all
three nodes running and ready in one sweep, the runs stream, its work consumer, the advisory
stream and the backstop consumer each led — which is what lets the full soak chain a dozen of
them (issue 21). CI runs each kind once here, so the soak's fault maker cannot rot between full
soaks (about 30 s).
"""

from __future__ import annotations

import random

import pytest

from publisher.config import WireSettings
from publisher.connection import connect
from publisher.streams import ensure_streams
from publisher.wire import WireNames
from tests.soak_cluster import KINDS, ClusterFaults
from tests.support.nats_cluster import Cluster, nats_cluster

__all__ = ["nats_cluster"]  # the module-scoped fixture, imported for this module's tests

pytestmark = [pytest.mark.timeout(240), pytest.mark.cluster]


async def test_every_cluster_fault_hits_its_node_and_leaves_the_cluster_whole(
    nats_cluster: Cluster, nats_prefix: str
) -> None:
    settings = WireSettings(nats_url=nats_cluster.url, namespace=nats_prefix, stream_replicas=3)
    names = WireNames(nats_prefix)
    nc, js = await connect(settings, name="test-cluster-faults")
    try:
        await ensure_streams(js, names, settings)
    finally:
        await nc.close()
    said: list[str] = []
    faults = ClusterFaults(
        nats_cluster,
        stream=names.runs_stream,
        consumer=names.consumer,
        backstop=(names.advisory_stream, names.backstop_consumer),
        outage_s=0.5,
        pause_s=1.0,
        rng=random.Random(7),
        say=said.append,
    )
    for kind in KINDS:
        stream_leader = nats_cluster.name(await nats_cluster.leader_of(names.runs_stream))
        consumer_leader = nats_cluster.name(
            await nats_cluster.leader_of(names.runs_stream, names.consumer)
        )
        fault = await faults.run(kind)

        # Whole when `run` returned (all three ok in one sweep, every leader elected): health
        # may flap again while a peer catches up, so the test does not sample it once more.
        assert all(n.running and not n.paused for n in nats_cluster.nodes), (kind, said)
        if kind in ("kill_stream_leader", "stepdown_stream"):
            assert fault.node == stream_leader, (kind, fault)
        if kind in ("kill_consumer_leader", "stepdown_consumer", "pause"):
            assert fault.node == consumer_leader, (kind, fault)
        if kind == "stepdown_stream":
            new = nats_cluster.name(await nats_cluster.leader_of(names.runs_stream))
            assert new != fault.node, (kind, fault)
        if kind == "stepdown_consumer":
            new = nats_cluster.name(await nats_cluster.leader_of(names.runs_stream, names.consumer))
            assert new != fault.node, (kind, fault)
        if kind in ("kill_stream_leader", "kill_consumer_leader", "pause"):
            # A leader lost without a hand-over: the survivors elect after raft's timeout.
            assert fault.broker_wait_s > 1.0, (kind, fault)
        assert fault.took_s >= fault.broker_wait_s, (kind, fault)

    assert faults.counts() == dict.fromkeys(KINDS, 1)
    assert faults.max_broker_wait_s == max(f.broker_wait_s for f in faults.faults)
